"""What each enabled backend is made with: its own section of the settings.

The settings name their sections after the backends (`docker_image`, `e2b_*`, `ray_*`), so this
table is keyed by the registry's names; what a backend can do once made is asked of it
(`Backend.capabilities`), never decided here.
"""

from __future__ import annotations

from collections.abc import Callable

from code_interpreter_wire.spec import SandboxSpec
from orchestrator.config import Settings

# name -> (settings, the spec warm sandboxes are made for) -> the backend's configuration.
_SECTIONS: dict[str, Callable[[Settings, SandboxSpec], dict[str, object]]] = {
    "local": lambda s, _: {
        "state_dir": s.state_dir,
        "zygote_modules": list(s.preload_modules) if s.local_fork_kernels else [],
    },
    "docker": lambda s, _: {
        "state_dir": s.state_dir,
        "orchestrator_id": s.orchestrator_id,
        "image": s.docker_image,
        "runtime": s.docker_runtime,
        "zygote_modules": list(s.preload_modules) if s.docker_fork_kernels else [],
    },
    # Machines run the Docker backend's images (unpacked once from its engine).
    "gvisor": lambda s, _: {
        "state_dir": s.state_dir,
        "orchestrator_id": s.orchestrator_id,
        "image": s.docker_image,
        "root": s.gvisor_root,
    },
    # Virtual machines too, their root filesystems made from the same images.
    "microvm": lambda s, _: {
        "state_dir": s.state_dir,
        "orchestrator_id": s.orchestrator_id,
        "image": s.docker_image,
        "root": s.microvm_root,
        "accelerator": s.microvm_accelerator,
        "kernel_dir": s.microvm_kernel_dir,
        "templates": s.microvm_templates,
    },
    "e2b": lambda s, _: s.e2b_backend_config(),
    # Its warm actors (per node) are made by the backend itself, for the default spec.
    "ray": lambda s, pool_spec: s.ray_backend_config() | {"pool_spec": pool_spec},
    "wasm": lambda s, _: _wasm(s),
}


def _wasm(settings: Settings) -> dict[str, object]:
    config: dict[str, object] = {
        "state_dir": settings.state_dir,
        "wheels_dir": settings.wasm_wheels_dir,
        "memory_snapshot": settings.wasm_memory_snapshot,
    }
    if settings.wasm_pyodide_dir is not None:  # else the release `make install` fetched
        config["pyodide_dir"] = settings.wasm_pyodide_dir
    return config


def backend_config(settings: Settings, name: str, pool_spec: SandboxSpec) -> dict[str, object]:
    """The configuration `create_backend(name, ...)` takes, from the settings."""
    section = _SECTIONS.get(name)
    return {} if section is None else section(settings, pool_spec)  # none: its defaults
