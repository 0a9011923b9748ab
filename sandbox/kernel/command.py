"""How every backend starts a kernel: the same command line and environment everywhere."""

from __future__ import annotations

import math
from pathlib import Path

from code_interpreter_wire.spec import ResourceLimits

STARTUP_FILE = Path(__file__).parent.parent / "inside_kernel" / "startup.py"
# Where the start-up file sits inside a sandbox (bound by the local backend, copied by images).
STARTUP_FILE_IN_SANDBOX = "/opt/code-interpreter/startup.py"


def kernel_command(python: str, connection_file: str, startup_file: str) -> list[str]:
    return [
        python,
        "-m",
        "ipykernel_launcher",
        "-f",
        connection_file,
        f"--IPKernelApp.exec_files=['{startup_file}']",
        "--HistoryManager.enabled=False",
        "--IPKernelApp.quiet=True",
    ]


def kernel_environment(
    *, path: str, home: str, limits: ResourceLimits, extra: dict[str, str]
) -> dict[str, str]:
    """The kernel's whole environment: nothing of the host's leaks in."""
    threads = str(max(1, math.ceil(limits.cpus)))
    return {
        "PATH": path,
        "HOME": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "MPLCONFIGDIR": f"{home}/.matplotlib",
        "IPYTHONDIR": f"{home}/.ipython",
        "OPENBLAS_NUM_THREADS": threads,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        **extra,
    }
