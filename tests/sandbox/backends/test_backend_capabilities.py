"""Backends declare what they can do (`Backend.capabilities`); the registry finds them by name
without deciding anything by it."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from sandbox.backends.base import BackendCapabilities
from sandbox.backends.registry import BACKENDS, backend_type, create_backend, why_unavailable

pytestmark = pytest.mark.unit

# Ray is the cluster extra: its backend's module imports it.
INSTALLED = [name for name in BACKENDS if name != "ray" or importlib.util.find_spec("ray")]


@pytest.mark.parametrize("name", INSTALLED)
def test_every_backend_declares_its_capabilities_on_its_class(name: str) -> None:
    backend = backend_type(name)
    assert backend.name == name
    capabilities = backend.capabilities
    assert isinstance(capabilities, BackendCapabilities)
    assert "none" in capabilities.network_modes  # a sandbox may always be kept offline
    assert capabilities.pause == (capabilities.suspend or capabilities.snapshot)
    assert capabilities.egress_rules == ("allow_list" in capabilities.network_modes)
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities.images = not capabilities.images  # type: ignore[misc]


def test_what_each_backend_declares() -> None:
    local, docker, e2b = (backend_type(n).capabilities for n in ("local", "docker", "e2b"))
    assert local.egress_rules and docker.egress_rules
    assert not e2b.egress_rules and e2b.network_modes == ("none", "any")  # all or nothing
    assert not e2b.host_tools and local.host_tools and docker.host_tools
    assert e2b.suspend and not local.suspend and not docker.suspend
    assert docker.images and docker.runtimes and not local.images and not e2b.images
    assert not e2b.warm_pool and local.warm_pool
    assert not any(c.shared_across_nodes for c in (local, docker, e2b))
    assert local.host_dirs and docker.host_dirs and not e2b.host_dirs  # e2b's are in its VM
    gvisor = backend_type("gvisor").capabilities  # machines, saved whole by gVisor
    assert gvisor.suspend and gvisor.processes and gvisor.images and not gvisor.runtimes
    # Host tools and egress through its agent (sandbox/backends/gvisor/machine_channels.py).
    assert gvisor.network_modes == docker.network_modes and gvisor.host_tools


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
def test_the_ray_backends_sandboxes_are_shared_and_saved_through_their_actor() -> None:
    """Saved states of its sandboxes (the service keeps them only where every replica finds
    them: `saved_states_dir`); an engine pause where its node's backend has one (gVisor: the
    whole machine, carried through that same directory, node_machines.py)."""
    ray = backend_type("ray").capabilities
    assert ray.shared_across_nodes and ray.snapshot and ray.suspend
    assert ray.network_modes == ("none", "allow_list", "any")  # through its node's proxy
    assert not ray.warm_pool  # its nodes keep pools of their own
    assert not ray.host_dirs  # its nodes keep them, under their own state dirs


def test_the_wasm_backends_sandboxes_touch_nothing() -> None:
    """No network, no processes, no pause: Python in Pyodide, alone; host tools relayed by the
    service (its only way out)."""
    wasm = backend_type("wasm").capabilities
    assert wasm.network_modes == ("none",) and wasm.host_tools
    assert not (wasm.processes or wasm.pause or wasm.ports or wasm.root)
    assert not (wasm.images or wasm.runtimes or wasm.shared_across_nodes)


def test_an_unknown_backend_is_named_with_the_choices() -> None:
    with pytest.raises(
        ValueError, match="choose one of: local, docker, gvisor, e2b, ray, microvm, wasm"
    ):
        create_backend("nope")
    assert why_unavailable("nope") == "unknown backend 'nope'"


def test_a_backend_is_made_from_its_configurations_fields() -> None:
    backend = create_backend("e2b", api_key="k", template="mine")
    assert backend.name == "e2b"
    assert why_unavailable("e2b", api_key="k") is None
