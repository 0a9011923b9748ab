"""Where installs go, and root's environment without them: the sandbox's user installs into
the workspace (sandbox/install_places.py); a command as a machine's root keeps none of that
(sandbox/inside_kernel/machine_root.py, which names the places again, runs inside: the two
are kept in step here), except what its caller set for it alone."""

from __future__ import annotations

import pytest

from sandbox.egress_channel import proxy_environment
from sandbox.image_labels import IMAGE_PATH
from sandbox.inside_kernel import machine_root
from sandbox.inside_kernel.machine_root import root_environment
from sandbox.install_places import (
    PIP_TARGET_IN_SANDBOX,
    USER_BINS_IN_SANDBOX,
    USER_PREFIX_IN_SANDBOX,
    install_environment,
)

pytestmark = pytest.mark.unit


def test_machine_root_names_the_same_places() -> None:
    assert machine_root.USER_PREFIX == USER_PREFIX_IN_SANDBOX
    pointing = {k for k, v in install_environment().items() if v == USER_PREFIX_IN_SANDBOX}
    pointing |= {k for k, v in install_environment().items() if v == PIP_TARGET_IN_SANDBOX}
    assert set(machine_root.USER_INSTALLS) == pointing - {"PYTHONPATH"}
    assert tuple(IMAGE_PATH.split(":")[-2:]) == USER_BINS_IN_SANDBOX


def test_root_keeps_nothing_of_the_users_installs() -> None:
    user = {"PATH": IMAGE_PATH, "LANG": "C.UTF-8", **proxy_environment()}
    root = root_environment(user)
    assert not {"PIP_TARGET", "NPM_CONFIG_PREFIX", "PYTHONPATH"} & root.keys()
    assert root["PATH"] == "/opt/kernel/bin:/usr/local/bin:/usr/bin:/bin:" + (
        "/usr/local/sbin:/usr/sbin:/sbin"
    )
    assert (root["HOME"], root["USER"], root["LOGNAME"]) == ("/root", "root", "root")
    assert root["https_proxy"] == user["https_proxy"] and root["LANG"] == "C.UTF-8"
    # A PYTHONPATH with more than the workspace's keeps the rest.
    more = root_environment({**user, "PYTHONPATH": f"/opt/lib:{PIP_TARGET_IN_SANDBOX}"})
    assert more["PYTHONPATH"] == "/opt/lib"


def test_what_the_caller_set_for_the_command_is_kept() -> None:
    """`sudo NPM_CONFIG_PREFIX=/opt/x npm i -g ...`, `sudo PATH=... cmd`: as given."""
    user = {"PATH": IMAGE_PATH, **proxy_environment(), "NPM_CONFIG_PREFIX": "/opt/x"}
    root = root_environment(user, explicit={"NPM_CONFIG_PREFIX"})
    assert root["NPM_CONFIG_PREFIX"] == "/opt/x" and "PIP_TARGET" not in root
    own_path = root_environment({"PATH": "/home/user/.local/bin:/bin"}, explicit={"PATH"})
    assert own_path["PATH"] == "/home/user/.local/bin:/bin"
