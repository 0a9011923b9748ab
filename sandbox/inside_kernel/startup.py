"""Runs inside every Python kernel before any user code (ipykernel's `exec_files`, after
display_forms.py beside it), on every backend: stdin refused, per-execution environment, host
tools on the path, preloaded modules, which execution started each thread and child process.

Standard library only, beside what the kernel itself runs on (IPython). The Docker images copy
this file as it is. It must leave nothing behind in the user's namespace.
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


def _track_tool_origin() -> None:
    """Which execution started each thread, task and child process: its host-tool calls name
    it (host_tools.py reads `_cir_runtime.tool_origin`, or a child's environment), and the host
    refuses a call whose execution has ended and shows a human the code of the one that made
    it. Without this, a thread left running by one execution would call as whichever execution
    runs now.

    Each execution's origin comes in its execute request's metadata (the host puts it there);
    it is set at the start of each execution in a context variable, which asyncio tasks copy
    when made. Threads get their starter's, and the tasks of thread and process pools their
    submitter's. A child process gets its starter's in its environment, set where children are
    made: `subprocess` (whatever `env` it is given), a fork (`os.fork`, `pty.fork`,
    multiprocessing's fork) and multiprocessing's spawn and forkserver. The kernel's own
    environment never holds one, so a child made any other way (`os.system`, `os.posix_spawn`,
    C code) names none, and is refused: never wrong, sometimes refused.
    """
    import concurrent.futures
    import contextlib
    import contextvars
    import functools
    import importlib
    import inspect
    import multiprocessing.pool
    import multiprocessing.spawn
    import operator
    import os
    import subprocess
    import sys
    import threading
    import weakref
    from collections.abc import Callable, Iterable, Mapping
    from typing import Any

    env_name, metadata_key = "CIR_TOOL_ORIGIN", "cir_tool_origin"  # sandbox/host_channel.py
    env_names = {env_name, env_name.encode()}
    os.environ.pop(env_name, None)  # the kernel's own environment names no origin, ever
    origin: contextvars.ContextVar[str | None] = contextvars.ContextVar(
        "cir_tool_origin", default=None
    )
    sys.modules["_cir_runtime"].tool_origin = origin  # type: ignore[attr-defined]

    def at_execution_start() -> None:
        value = None
        try:
            from IPython import get_ipython

            kernel = getattr(get_ipython(), "kernel", None)
            parent = kernel.get_parent("shell") if kernel is not None else None
            found = (parent or {}).get("metadata", {}).get(metadata_key)
            value = found if isinstance(found, str) and found else None
        except Exception:  # no kernel, or an odd request: the call then names no origin
            value = None
        origin.set(value)

    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:  # every execution, silent ones included
            shell.events.register("pre_execute", at_execution_start)
    except ImportError:
        pass

    def carrying(fn: Callable[..., Any], value: str | None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            token = origin.set(value)
            try:
                return fn(*args, **kwargs)
            finally:
                origin.reset(token)

        return run

    # Threads: the starter's origin is kept beside the thread (not in it) until the new thread
    # sets it in its own context, first thing.
    starting: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()
    thread_start = threading.Thread.start
    bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    @functools.wraps(thread_start)
    def start(self: threading.Thread) -> None:
        value = origin.get()
        if value is not None:
            with contextlib.suppress(TypeError):  # an unhashable thread: it names none
                starting[self] = value
        thread_start(self)

    @functools.wraps(bootstrap_inner)
    def _bootstrap_inner(self: threading.Thread) -> None:
        value = None
        with contextlib.suppress(TypeError):
            value = starting.pop(self, None)
        if value is not None:  # a new thread's context is its own: nothing to put back
            origin.set(value)
        bootstrap_inner(self)

    threading.Thread.start = start  # type: ignore[method-assign]
    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]

    # Thread pools: each work item runs with its submitter's origin, whoever started the worker.
    pool_submit = concurrent.futures.ThreadPoolExecutor.submit

    @functools.wraps(pool_submit)  # type: ignore[arg-type]
    def submit(
        self: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any,
        **kwargs: Any,
    ) -> concurrent.futures.Future[Any]:  # fmt: skip
        return pool_submit(self, carrying(fn, origin.get()), *args, **kwargs)

    concurrent.futures.ThreadPoolExecutor.submit = submit  # type: ignore[method-assign,assignment]

    # A child process unpickles what multiprocessing sends it (a spawned one has nothing of
    # this file): a `Call` there runs as it is unpickled, so it can set the sender's origin.
    class Call:
        """Pickles as the call `fn(*args)`, made where it is unpickled (`fn`: a callable of the
        standard library; `args` may be Calls, or hold what a forked copy of this kernel has)."""

        def __init__(self, fn: object, *args: object) -> None:
            self.call = (fn, args)

        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return self.call

    child_environ = Call(getattr, Call(importlib.import_module, "os"), "environ")
    child_variable = Call(getattr, Call(importlib.import_module, "_cir_runtime"), "tool_origin")

    def origin_in_environ(value: str | None) -> Call:
        if value is None:
            return Call(operator.methodcaller("pop", env_name, None), child_environ)
        return Call(operator.setitem, child_environ, env_name, value)

    # Process pools: a worker runs the tasks of whoever submits them, so each task carries its
    # submitter's origin, set in the worker as it unpickles the task, right before running it
    # (a forked worker is a copy of this kernel: its context variable too).
    class Marked:
        """A process pool's task: `func` here; pickled, `func` again, which the worker makes
        once `steps` (each a `Call`) have run there."""

        def __init__(self, func: Callable[..., Any], steps: tuple[Call, ...]) -> None:
            self.func, self.steps = func, steps

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.func(*args, **kwargs)

        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return operator.getitem, ((*self.steps, self.func), len(self.steps))

    def marked(func: Callable[..., Any], context: Any) -> Callable[..., Any]:
        try:
            forked = context.get_start_method() == "fork"
        except Exception:  # not a context this knows: the worker's own origin
            return func
        value = origin.get()
        steps: tuple[Call, ...] = (origin_in_environ(value),)
        if forked:
            steps += (Call(operator.methodcaller("set", value), child_variable),)
        return Marked(func, steps)

    process_pool_submit = concurrent.futures.ProcessPoolExecutor.submit

    @functools.wraps(process_pool_submit)  # type: ignore[arg-type]
    def process_submit(
        self: concurrent.futures.ProcessPoolExecutor, fn: Callable[..., Any], /, *args: Any,
        **kwargs: Any,
    ) -> concurrent.futures.Future[Any]:  # fmt: skip
        task = marked(fn, getattr(self, "_mp_context", None))
        return process_pool_submit(self, task, *args, **kwargs)

    concurrent.futures.ProcessPoolExecutor.submit = process_submit  # type: ignore[method-assign,assignment]
    # multiprocessing's pools: every way of submitting goes through these two. A thread pool's
    # work runs here, with its submitter's context; a process pool's is pickled, and marked.
    pool_class, thread_pool = multiprocessing.pool.Pool, multiprocessing.pool.ThreadPool
    apply_async = pool_class.apply_async
    task_generation = pool_class._guarded_task_generation  # type: ignore[attr-defined]

    def with_submitters(pool: multiprocessing.pool.Pool, func: Callable[..., Any]) -> Any:
        if isinstance(pool, thread_pool):
            return carrying(func, origin.get())
        return marked(func, getattr(pool, "_ctx", None))

    @functools.wraps(apply_async)
    def apply_async_carrying(
        self: multiprocessing.pool.Pool, func: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        return apply_async(self, with_submitters(self, func), *args, **kwargs)

    @functools.wraps(task_generation)
    def _guarded_task_generation(
        self: multiprocessing.pool.Pool, job: int, func: Callable[..., Any], tasks: Iterable[Any]
    ) -> Any:
        # Called by the submitter, in its thread; the tasks are made later, in the pool's.
        return task_generation(self, job, with_submitters(self, func), tasks)

    pool_class.apply_async = apply_async_carrying  # type: ignore[method-assign]
    pool_class._guarded_task_generation = _guarded_task_generation  # type: ignore[attr-defined]

    # subprocess: the child's environment names the starter's origin, whatever `env` was given.
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    child_parameters = inspect.signature(execute_child)

    def with_origin(env: Mapping[Any, Any] | None) -> Mapping[Any, Any] | None:
        value = origin.get()
        if env is None and value is None and env_name not in os.environ:
            return None  # it inherits the kernel's, which names none
        kept = {k: v for k, v in (os.environ if env is None else env).items() if k not in env_names}
        if value is not None:
            kept[env_name] = value
        return kept

    @functools.wraps(execute_child)
    def _execute_child(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> Any:
        try:
            bound = child_parameters.bind(self, *args, **kwargs)
            bound.arguments["env"] = with_origin(bound.arguments.get("env"))
        except Exception:  # not an environment at all: Popen itself says what is wrong
            return execute_child(self, *args, **kwargs)
        return execute_child(*bound.args, **bound.kwargs)

    subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]

    # A fork (os.fork, os.forkpty, multiprocessing's fork): the forking thread's origin, in the
    # child's environment too (what it execs inherits it).
    def in_forked_child() -> None:
        value = origin.get()
        if value is None:
            os.environ.pop(env_name, None)
        else:
            os.environ[env_name] = value

    os.register_at_fork(after_in_child=in_forked_child)

    # multiprocessing's spawn and forkserver: the child unpickles what the starter prepared for
    # it before the process object; an entry there sets the starter's origin in its environment.
    preparation_data = multiprocessing.spawn.get_preparation_data

    @functools.wraps(preparation_data)
    def get_preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = preparation_data(name)
        data[metadata_key] = origin_in_environ(origin.get())
        return data

    multiprocessing.spawn.get_preparation_data = get_preparation_data


_setup()
try:
    _track_tool_origin()
except Exception:
    __import__("logging").getLogger(__name__).debug("tool origins unavailable", exc_info=True)


def _move_iopub_pipe(path: str) -> None:
    """Where the kernel's sandbox must be saved whole (a gVisor machine, whose gVisor cannot
    save a listening TCP socket), the pipe ipykernel listens on for forked children's output
    moves from a loopback TCP port to an ipc socket at `path`, for its children too."""
    import threading

    import zmq

    thread = get_ipython().kernel.iopub_thread  # type: ignore[name-defined]  # noqa: F821
    if not getattr(thread, "_pipe_flag", False) or getattr(thread, "_pipe_in", None) is None:
        return
    moved = threading.Event()

    def move() -> None:  # on the IOPub thread, which owns the socket
        try:
            sock = thread._pipe_in.socket
            sock.unbind(sock.getsockopt(zmq.LAST_ENDPOINT))
            sock.bind(f"ipc://{path}")
        finally:
            moved.set()

    def pipe_out() -> tuple[object, object]:
        context = zmq.Context()
        out = context.socket(zmq.PUSH)
        out.linger = 3000
        out.connect(f"ipc://{path}")
        return context, out

    thread._setup_pipe_out = pipe_out
    thread.io_loop.add_callback(move)
    moved.wait(10)


def _inline_backend_hooked() -> None:
    """matplotlib's inline backend hooks into the IPython shell there is as it is imported
    (its figures shown at the end of a cell, closed after): one imported before this kernel's
    shell existed (in the zygote a forked kernel comes from) hooks into this one now, as it
    would have. Elsewhere it is not imported yet, and hooks in itself on its import."""
    import sys

    backend_inline = sys.modules.get("matplotlib_inline.backend_inline")
    if backend_inline is None:
        return
    from IPython.core.pylabtools import activate_matplotlib
    from matplotlib import get_backend

    backend = get_backend()
    if backend in ("inline", "module://matplotlib_inline.backend_inline"):
        activate_matplotlib(backend)  # type: ignore[no-untyped-call]
        backend_inline.configure_inline_support(get_ipython(), backend)  # type: ignore[name-defined]  # noqa: F821


if __import__("os").environ.get("CIR_IOPUB_PIPE"):
    _move_iopub_pipe(__import__("os").environ["CIR_IOPUB_PIPE"])
_inline_backend_hooked()
del _setup, _track_tool_origin, _move_iopub_pipe, _inline_backend_hooked
