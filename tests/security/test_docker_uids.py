"""Each Docker sandbox runs as a host uid of its own (issue 13, item 10).

Some kernel quotas are counted per host uid, whatever the container: inotify instances
(`fs.inotify.max_user_instances`) and the bytes of POSIX message queues (RLIMIT_MSGQUEUE). When
every container ran as uid 1000, one session holding them all broke every other session's.
"""

from __future__ import annotations

import pwd
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import pytest

from code_interpreter_wire.spec import ResourceLimits
from sandbox import Backend, Sandbox, create_backend
from sandbox.backends.docker import DockerSandbox
from tests.conftest import TEST_ORCHESTRATOR_ID, require_backend, small_spec

MAX_INOTIFY = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())

# Kernel-side helpers, run inside the sandboxes. POSIX message queues through libc (glibc has
# mq_open in libc itself since 2.34); the queues live in the container's own IPC namespace, but
# their bytes count against the uid's RLIMIT_MSGQUEUE.
HELPERS = """
import ctypes, os
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]

def new_inotify():
    fd = _libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return fd

def new_mqueue(name):
    fd = _libc.mq_open(name.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return fd
"""

EXHAUST = f"""
held_inotify, held_mqueues, why = [], [], {{}}
try:
    for _ in range({MAX_INOTIFY + 16}):
        held_inotify.append(new_inotify())
except OSError as e:
    why['inotify'] = e.strerror
try:
    for i in range(1000):
        held_mqueues.append(new_mqueue(f'/hog-{{i}}'))
except OSError as e:
    why['mqueue'] = e.strerror
(len(held_inotify), len(held_mqueues), sorted(why))
"""

USE_BOTH = """
works = {}
for name, make in (('inotify', new_inotify), ('mqueue', lambda: new_mqueue('/mine'))):
    try:
        os.close(make())
        works[name] = 'ok'
    except OSError as e:
        works[name] = e.strerror
works
"""


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    require_backend("docker")
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture
async def docker_backend(engine: docker.DockerClient) -> AsyncIterator[Backend]:
    backend = create_backend("docker", orchestrator_id=TEST_ORCHESTRATOR_ID)
    yield backend
    await backend.close()


@pytest.fixture
async def two(docker_backend: Backend) -> AsyncIterator[tuple[Sandbox, Sandbox]]:
    spec = small_spec(limits=ResourceLimits(open_files=MAX_INOTIFY + 256, tmp_size_mb=64))
    first = await docker_backend.create(spec)
    try:
        second = await docker_backend.create(spec)
        try:
            for sb in (first, second):
                assert (await sb.execute(HELPERS)).ok
            yield first, second
        finally:
            await second.close()
    finally:
        await first.close()


def user_of(engine: docker.DockerClient, sb: Sandbox) -> str:
    assert isinstance(sb, DockerSandbox) and sb.container_name is not None
    return str(engine.api.inspect_container(sb.container_name)["Config"]["User"])


async def test_each_sandbox_runs_as_a_host_uid_of_its_own(
    engine: docker.DockerClient, two: tuple[Sandbox, Sandbox]
) -> None:
    inside = []
    for sb in two:
        ex = await sb.execute("import os; (os.getuid(), os.getgid())")
        uid, gid = eval(ex.text or "")
        assert uid == gid and uid != 0
        assert user_of(engine, sb) == f"{uid}:{gid}"
        await sb.execute("open('made.txt', 'w').write('y')")  # its files: its uid's
        assert isinstance(sb, DockerSandbox)
        assert (sb.dirs.workspace / "made.txt").stat().st_uid == uid
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)  # never a real user of the host
        inside.append(uid)
    assert inside[0] != inside[1]


async def test_a_sandbox_exhausting_per_uid_quotas_leaves_others_theirs(
    two: tuple[Sandbox, Sandbox],
) -> None:
    hog, other = two
    exhausted = await hog.execute(EXHAUST, timeout_s=120)
    assert exhausted.ok, exhausted.error
    inotify, mqueues, failed = eval(exhausted.text or "")
    assert failed == ["inotify", "mqueue"], "the quotas were not reached"
    assert inotify <= MAX_INOTIFY and mqueues >= 1
    try:
        ex = await other.execute(USE_BOTH)
        assert ex.text == "{'inotify': 'ok', 'mqueue': 'ok'}", ex.error
    finally:
        await hog.execute("[os.close(fd) for fd in held_inotify + held_mqueues]")


async def test_the_image_works_under_an_arbitrary_uid(docker_backend: Backend) -> None:
    """Home, user name, pip and matplotlib, for a uid the image was not built with."""
    async with await docker_backend.create(small_spec()) as sb:
        ex = await sb.execute(
            "import getpass, os, pwd, subprocess, sys\n"
            "import matplotlib.pyplot as plt\n"
            "plt.plot([1, 2]); plt.show()\n"
            "pip = subprocess.run([sys.executable, '-m', 'pip', 'list'], capture_output=True)\n"
            "(getpass.getuser(), os.path.expanduser('~'), pwd.getpwuid(os.getuid()).pw_dir,"
            " pip.returncode, b'numpy' in pip.stdout)"
        )
        assert ex.ok, ex.error
        assert any(r.png for r in ex.results)
        assert ex.results[-1].text == "('sandbox', '/tmp', '/tmp', 0, True)"
