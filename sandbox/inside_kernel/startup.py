"""Runs inside every kernel before any user code (ipykernel's `exec_files`), on every backend.

Standard library only: the Docker images copy this file as it is. It must leave nothing behind
in the user's namespace.
"""


def _setup() -> None:
    import contextlib
    import io
    import os
    import sys
    import types

    class _NoStdin(io.TextIOBase):
        """Reading stdin fails at once with a clear error instead of hanging the execution."""

        def _refuse(self) -> OSError:
            return OSError(
                "stdin is not available in this sandbox: nobody can type an answer. "
                "Put the data in the code, or in a file in the workspace, and read it from there."
            )

        def read(self, size: int | None = -1, /) -> str:
            raise self._refuse()

        def readline(self, size: int | None = -1, /) -> str:  # type: ignore[override]
            raise self._refuse()

        def readlines(self, hint: int = -1, /) -> list[str]:  # type: ignore[override]
            raise self._refuse()

        def readable(self) -> bool:
            return True

        def isatty(self) -> bool:
            return False

    sys.stdin = _NoStdin()

    # Per-execution environment variables and working directory, set before the code and put
    # back after it (see KernelDriver.execute).
    runtime = types.ModuleType("_cir_runtime")
    saved: list[tuple[dict[str, str | None], str, str]] = []

    def enter(env: dict[str, str], cwd: str | None) -> None:
        previous = {key: os.environ.get(key) for key in env}
        old_cwd = os.getcwd()
        if cwd is not None:
            os.chdir(cwd)
        os.environ.update(env)
        saved.append((previous, old_cwd, os.getcwd()))

    def exit() -> None:
        if not saved:
            return
        previous, old_cwd, set_cwd = saved.pop()
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if os.getcwd() == set_cwd:  # the code did not move on its own: go back
            with contextlib.suppress(OSError):
                os.chdir(old_cwd)

    runtime.enter = enter  # type: ignore[attr-defined]
    runtime.exit = exit  # type: ignore[attr-defined]
    sys.modules["_cir_runtime"] = runtime

    # Host tools: the orchestrator's channel directory holds the `host_tools` module.
    tools_dir = os.environ.get("CIR_HOST_TOOLS_DIR")
    if tools_dir and tools_dir not in sys.path:
        sys.path.append(tools_dir)

    preload = os.environ.get("CIR_PRELOAD_MODULES", "")
    for name in filter(None, (m.strip() for m in preload.split(","))):
        with contextlib.suppress(Exception):  # a missing module must not stop the kernel
            __import__(name)


_setup()
del _setup
