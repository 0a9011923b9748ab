"""How every backend starts a kernel: the same command line and environment everywhere."""

from __future__ import annotations

import math
from pathlib import Path, PurePosixPath

from code_interpreter_wire.spec import ResourceLimits

STARTUP_FILE = Path(__file__).parent.parent / "inside_kernel" / "startup.py"
# Run before the start-up file, from the same directory wherever that is (its own idea: the
# display forms and the patches of libraries; placed beside it by every backend and image).
DISPLAY_FORMS_FILE = STARTUP_FILE.with_name("display_forms.py")
# Where the start-up file sits inside a sandbox (bound by the local backend, copied by images).
STARTUP_FILE_IN_SANDBOX = "/opt/code-interpreter/startup.py"
DISPLAY_FORMS_FILE_IN_SANDBOX = "/opt/code-interpreter/display_forms.py"
# Each file run in a Python kernel before any user code, and where it sits inside a sandbox.
KERNEL_START_FILES = (
    (DISPLAY_FORMS_FILE, DISPLAY_FORMS_FILE_IN_SANDBOX),
    (STARTUP_FILE, STARTUP_FILE_IN_SANDBOX),
)


def kernel_command(python: str, connection_file: str, startup_file: str) -> list[str]:
    """Python's kernel command: the display forms' file beside `startup_file` runs first."""
    forms = str(PurePosixPath(startup_file).with_name(DISPLAY_FORMS_FILE.name))
    return [
        python,
        "-m",
        "ipykernel_launcher",
        "-f",
        connection_file,
        f"--IPKernelApp.exec_files=['{forms}', '{startup_file}']",
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
