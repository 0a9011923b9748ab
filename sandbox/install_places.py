"""Where a sandbox's user installs without root: in the workspace, under /home/user/.local.

The images' root is read-only (Docker) or shared (local), and their user unprivileged, so
`pip install` and `npm i -g` go to the workspace: they survive a kernel restart, count against
its size, and are found at once (PYTHONPATH; PATH ends in USER_BINS_IN_SANDBOX). Root, where a
machine has one, installs into the image's own places instead: its environment drops these
(sandbox/inside_kernel/machine_root.py, which names them again: it runs inside, standard library
only; tests/sandbox/test_install_places.py keeps the two in step).
"""

from __future__ import annotations

USER_PREFIX_IN_SANDBOX = "/home/user/.local"
USER_BIN_IN_SANDBOX = f"{USER_PREFIX_IN_SANDBOX}/bin"
PIP_TARGET_IN_SANDBOX = f"{USER_PREFIX_IN_SANDBOX}/lib/python3/site-packages"
# Where the commands installed go, at the end of PATH: npm's, and pip's (`pip install --target`
# puts a package's console scripts in the target's bin).
USER_BINS_IN_SANDBOX = (USER_BIN_IN_SANDBOX, f"{PIP_TARGET_IN_SANDBOX}/bin")


def install_environment() -> dict[str, str]:
    """The variables that send installs to the workspace, for a sandbox with a network (there
    is nothing to fetch without one); a session's own variables may change them."""
    return {
        # The kernels' Pythons are virtual environments on a read-only root: packages go to the
        # workspace, which PYTHONPATH puts ahead of the image's own.
        "PIP_TARGET": PIP_TARGET_IN_SANDBOX,
        "PYTHONPATH": PIP_TARGET_IN_SANDBOX,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
        # `npm i -g` into the workspace (its commands in USER_BIN_IN_SANDBOX, on PATH); no calls
        # besides the install's own (update checks, audits, funding notices).
        "NPM_CONFIG_PREFIX": USER_PREFIX_IN_SANDBOX,
        "NPM_CONFIG_UPDATE_NOTIFIER": "false",
        "NPM_CONFIG_AUDIT": "false",
        "NPM_CONFIG_FUND": "false",
    }
