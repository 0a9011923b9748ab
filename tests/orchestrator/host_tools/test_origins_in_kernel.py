"""What a call frame names as its origin, in the kernel: the execution that started the calling
thread, thread-pool work item, asyncio task or child process, never merely the one running now
(the host refuses calls of origins that ended:
tests/orchestrator/governance/test_call_origins.py)."""

from __future__ import annotations

from code_interpreter_wire.results import ExecutionStatus
from sandbox.host_channel import TOOL_ORIGIN_ENV
from tests.orchestrator.host_tools.conftest import ToolSandbox

FIRST = """
import asyncio, concurrent.futures, subprocess, sys, threading
seen = {}
go = threading.Event()
def in_thread():
    go.wait(30)
    seen["thread"] = host_tools._origin()
    seen["child"] = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('CIR_TOOL_ORIGIN'))"],
        capture_output=True, text=True,
    ).stdout.strip()
stray = threading.Thread(target=in_thread)
stray.start()
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: None).result()  # its worker thread starts now, during this execution
async def in_task():
    while not go.is_set():
        await asyncio.sleep(0.01)
    seen["task"] = host_tools._origin()
task = asyncio.ensure_future(in_task())
print(host_tools._origin())
"""
SECOND = """
seen["pool"] = pool.submit(host_tools._origin).result()
seen["now"] = host_tools._origin()
go.set()
stray.join(30)
await task
print(sorted(seen.items()))
"""


async def test_threads_tasks_pools_and_children_carry_their_starters_origin(
    tool_sandbox: ToolSandbox,
) -> None:
    sandbox = tool_sandbox.sandbox
    first = await sandbox.execute(FIRST, timeout_s=60, env={TOOL_ORIGIN_ENV: "exec-first"})
    assert first.status is ExecutionStatus.OK, first.error
    assert first.stdout == "exec-first\n"
    second = await sandbox.execute(
        SECOND, timeout_s=60, env={TOOL_ORIGIN_ENV: "exec-second", "SOMETHING": "else"}
    )
    assert second.status is ExecutionStatus.OK, second.error
    assert second.stdout == (
        "[('child', 'exec-first'), ('now', 'exec-second'), ('pool', 'exec-second'), "
        "('task', 'exec-first'), ('thread', 'exec-first')]\n"
    )
    # An execution that names no origin: its calls name none (the host refuses them).
    third = await sandbox.execute(
        f"import os\nprint(host_tools._origin(), os.environ.get({TOOL_ORIGIN_ENV!r}))"
    )
    assert third.stdout == "None None\n", third


# A thread of execution 1 makes children every way there is while execution 2 runs; each child
# reports the origin a call of its would name (a spawned child through a module of the
# workspace: what the kernel defines cannot be pickled by reference).
LAUNCHER = """
import concurrent.futures, multiprocessing, multiprocessing.pool, os, subprocess, sys, threading
probe_dir = os.path.abspath("origin_probe")
os.makedirs(probe_dir, exist_ok=True)
with open(os.path.join(probe_dir, "cir_origin_probe.py"), "w") as f:
    f.write("import os, host_tools\\n"
            "def report(path):\\n    open(path, 'w').write(str(host_tools._origin()))\\n"
            "def origin(*_):\\n    return host_tools._origin()\\n"
            "def environ(*_):\\n    return os.environ.get('CIR_TOOL_ORIGIN')\\n")
sys.path.insert(0, probe_dir)
import cir_origin_probe
REPORT = "import os; print(os.environ.get('CIR_TOOL_ORIGIN'))"
children = {}
go = threading.Event()
def launch():
    go.wait(60)
    children["copied env"] = subprocess.run(
        [sys.executable, "-c", REPORT], env=dict(os.environ), capture_output=True, text=True
    ).stdout.strip()
    children["no env"] = subprocess.run(
        [sys.executable, "-c", REPORT], capture_output=True, text=True
    ).stdout.strip()
    os.system(f'{sys.executable} -c "{REPORT}" > system.txt')
    children["os.system"] = open("system.txt").read().strip()
    for method in ("spawn", "forkserver", "fork"):
        path = os.path.abspath(f"{method}.txt")
        context = multiprocessing.get_context(method)
        child = context.Process(target=cir_origin_probe.report, args=(path,))
        child.start()
        child.join(60)
        children[method] = open(path).read()
    # Pools whose workers execution 2 started: each task names its submitter.
    children["spawn pool"] = spawn_pool.submit(cir_origin_probe.origin).result(60)
    children["spawn pool environ"] = spawn_pool.submit(cir_origin_probe.environ).result(60)
    children["fork pool"] = fork_pool.apply(cir_origin_probe.origin)
    children["fork pool environ"] = fork_pool.map(cir_origin_probe.environ, [1])
spawn_pool = concurrent.futures.ProcessPoolExecutor(
    1, mp_context=multiprocessing.get_context("spawn")
)
fork_pool = multiprocessing.get_context("fork").Pool(1)  # its worker starts now
launcher = threading.Thread(target=launch)
launcher.start()
thread_pool = multiprocessing.pool.ThreadPool(1)
thread_pool.apply(lambda: None)  # its worker thread starts now, during this execution
print(host_tools._origin(), "CIR_TOOL_ORIGIN" in os.environ)
"""
DURING = """
children["spawn pool, by 2"] = spawn_pool.submit(cir_origin_probe.origin).result(60)
children["fork pool, by 2"] = fork_pool.apply(cir_origin_probe.origin)
go.set()
launcher.join(120)
children["thread pool apply"] = thread_pool.apply(host_tools._origin)
children["thread pool map"] = thread_pool.map(lambda _: host_tools._origin(), [1, 2])
children["thread pool imap"] = list(thread_pool.imap(lambda _: host_tools._origin(), [1]))
children["mine"] = subprocess.run(
    [sys.executable, "-c", REPORT], env=dict(os.environ), capture_output=True, text=True
).stdout.strip()
thread_pool.close()
spawn_pool.shutdown()
fork_pool.close()
fork_pool.join()
print(sorted(children.items()), "CIR_TOOL_ORIGIN" in os.environ)
"""


async def test_children_of_an_earlier_executions_thread_never_name_the_current_one(
    tool_sandbox: ToolSandbox,
) -> None:
    """A child made by a thread execution 1 left running names execution 1 (or nothing, where
    no hook reaches: `os.system`), never execution 2, which runs when it starts; the kernel's
    own environment holds no origin at all. A pool's task names its submitter, whoever started
    the pool's workers (threads, forked or spawned processes)."""
    sandbox = tool_sandbox.sandbox
    first = await sandbox.execute(LAUNCHER, timeout_s=60, env={TOOL_ORIGIN_ENV: "exec-one"})
    assert first.status is ExecutionStatus.OK, (first.error, first.stderr)
    assert first.stdout == "exec-one False\n", first
    second = await sandbox.execute(DURING, timeout_s=180, env={TOOL_ORIGIN_ENV: "exec-two"})
    assert second.status is ExecutionStatus.OK, (second.error, second.stderr)
    assert second.stdout == (
        "[('copied env', 'exec-one'), ('fork', 'exec-one'), ('fork pool', 'exec-one'), "
        "('fork pool environ', ['exec-one']), ('fork pool, by 2', 'exec-two'), "
        "('forkserver', 'exec-one'), ('mine', 'exec-two'), ('no env', 'exec-one'), "
        "('os.system', 'None'), ('spawn', 'exec-one'), ('spawn pool', 'exec-one'), "
        "('spawn pool environ', 'exec-one'), ('spawn pool, by 2', 'exec-two'), "
        "('thread pool apply', 'exec-two'), ('thread pool imap', ['exec-two']), "
        "('thread pool map', ['exec-two', 'exec-two'])] False\n"
    ), second


INVISIBLE = """
import inspect, subprocess, threading
class Frozen(threading.Thread):
    \"\"\"A thread whose public attributes are fixed once made (threading sets private ones).\"\"\"
    def __init__(self):
        super().__init__()
        self.seen = []
        self.made = True
    def __setattr__(self, name, value):
        if getattr(self, "made", False) and not name.startswith("_"):
            raise AttributeError(f"frozen: {name}")
        super().__setattr__(name, value)
    def run(self):
        self.seen.append(host_tools._origin())
frozen = Frozen()
frozen.start()
frozen.join(30)
plain = threading.Thread(target=lambda: None)
plain.start()
plain.join(30)
print(frozen.seen[0], "run" in vars(plain), threading.Thread.start.__qualname__,
      threading.Thread.start.__doc__ is not None,
      str(inspect.signature(subprocess.Popen)).startswith("(args, bufsize=-1"))
"""


async def test_the_kernels_hooks_do_not_show_in_what_the_code_sees(
    tool_sandbox: ToolSandbox,
) -> None:
    """A thread keeps its own attributes (its `run` is not replaced, so a subclass that refuses
    to set one still starts), and the patched functions keep their names, docs and signatures."""
    ran = await tool_sandbox.sandbox.execute(
        INVISIBLE, timeout_s=60, env={TOOL_ORIGIN_ENV: "exec-three"}
    )
    assert ran.status is ExecutionStatus.OK, (ran.error, ran.stderr)
    assert ran.stdout == "exec-three False Thread.start True True\n", ran
