"""The sandbox's walls, each shown from inside the sandbox, on every backend."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend, Sandbox
from tests.conftest import host_processes_with, small_spec


async def run_ok(sb: Sandbox, code: str) -> str:
    ex = await sb.execute(code, timeout_s=60)
    assert ex.status is ExecutionStatus.OK, (ex.error, ex.stdout, ex.stderr)
    assert ex.text is not None
    return ex.text


async def test_network_has_only_loopback_and_cannot_reach_the_host(
    sandbox: Sandbox, host_listener: int
) -> None:
    names = await run_ok(sandbox, "import socket; [n for _, n in socket.if_nameindex()]")
    assert names == "['lo']"
    result = await run_ok(
        sandbox,
        "import socket\n"
        "def attempt():\n"
        "    s = socket.socket(); s.settimeout(3)\n"
        "    try:\n"
        f"        s.connect(('127.0.0.1', {host_listener})); return 'connected'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        "attempt()",
    )
    assert result != "'connected'"
    udp = await run_ok(
        sandbox,
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"s.sendto(b'x', ('127.0.0.1', {host_listener})); 'sent only to its own lo'",
    )
    assert udp == "'sent only to its own lo'"
    dns = await run_ok(
        sandbox,
        "try:\n    socket.getaddrinfo('example.com', 80); r = 'resolved'\n"
        "except OSError as e:\n    r = type(e).__name__\nr",
    )
    assert dns != "'resolved'"


async def test_not_root_and_no_capabilities(sandbox: Sandbox) -> None:
    uid = await run_ok(sandbox, "import os; os.getuid(), os.geteuid(), os.getgid()")
    assert "0" not in uid.strip("()").replace(" ", "").split(",")
    caps = await run_ok(
        sandbox,
        "[l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm'))]",
    )
    assert caps == "['0000000000000000', '0000000000000000']"


async def test_writes_outside_the_workspace_fail(sandbox: Sandbox) -> None:
    code = (
        "import os\n"
        "outcomes = {}\n"
        "for p in ['/usr/evil', '/etc/evil', '/evil', '/opt/evil', '/run/evil']:\n"
        "    try:\n"
        "        open(p, 'w').write('x'); outcomes[p] = 'written'\n"
        "    except OSError as e:\n"
        "        outcomes[p] = 'refused'\n"
        "open('/workspace/ok.txt', 'w').write('fine')\n"
        "open('/tmp/ok.txt', 'w').write('fine')\n"
        "sorted(set(outcomes.values()))"
    )
    assert await run_ok(sandbox, code) == "['refused']"


async def test_no_host_secrets_in_any_environment(backend: Backend) -> None:
    canary = f"cir-canary-{uuid.uuid4().hex}"
    os.environ["CIR_TEST_CANARY"] = canary
    try:
        async with await backend.create(small_spec(env={"MINE": "given"})) as sb:
            code = (
                "import os, glob\n"
                "envs = [open(p, 'rb').read() for p in glob.glob('/proc/[0-9]*/environ')]\n"
                "first = open('/proc/1/environ', 'rb').read().split(b'\\0')\n"
                "(envs, sorted(os.environ), sorted(v.split(b'=')[0].decode() for v in first if v))"
            )
            ex = await sb.execute(code)
            assert ex.ok, ex.error
            envs, kernel_names, first_names = eval(ex.text or "")
            assert len(envs) >= 2
            assert canary.encode() not in b"\0".join(envs)
            assert "CIR_TEST_CANARY" not in kernel_names and "MINE" in kernel_names
            # Every variable of every process is one the kernel was given (Docker adds the
            # hostname, the kernel its working directory): nothing else of the host's.
            given = set(kernel_names) | {"HOSTNAME", "PWD"}
            for environ in envs:
                names = {v.split(b"=")[0].decode() for v in environ.split(b"\0") if v}
                assert names <= given, names - given
            assert set(first_names) <= given
    finally:
        del os.environ["CIR_TEST_CANARY"]


async def test_host_files_are_out_of_sight(sandbox: Sandbox) -> None:
    code = (
        "import os\n"
        "def readable(p):\n"
        "    try:\n"
        "        open(p, 'rb').read(1); return True\n"
        "    except OSError:\n"
        "        return False\n"
        "secrets = ['/etc/shadow', '/etc/gshadow', '/root/.bashrc', '/proc/kcore',"
        " '/etc/ssh/ssh_host_rsa_key']\n"
        "engines = ['/var/run/docker.sock', '/run/docker.sock', '/dev/kvm', '/run/containerd']\n"
        "[p for p in secrets if readable(p)] + [p for p in engines if os.path.exists(p)]"
    )
    assert await run_ok(sandbox, code) == "[]"


async def test_no_new_user_namespaces_or_privileges(sandbox: Sandbox) -> None:
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000\n"
        "r1 = libc.unshare(CLONE_NEWUSER)\n"
        "r2 = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)\n"
        "try:\n"
        "    os.setuid(0); r3 = 0\n"
        "except OSError:\n"
        "    r3 = -1\n"
        "(r1, r2, r3)"
    )
    assert await run_ok(sandbox, code) == "(-1, -1, -1)"


async def test_private_tmp_is_size_capped(backend: Backend) -> None:
    async with await backend.create(small_spec()) as sb:  # tmp_size_mb=64
        code = (
            "import errno\n"
            "try:\n"
            "    with open('/tmp/fill', 'wb') as f:\n"
            "        for _ in range(100): f.write(b'x' * (1 << 20))\n"
            "    r = 'filled'\n"
            "except OSError as e:\n"
            "    r = errno.errorcode[e.errno]\n"
            "r"
        )
        assert await run_ok(sb, code) == "'ENOSPC'"


async def test_rlimits_apply(sandbox: Sandbox) -> None:
    limits = await run_ok(
        sandbox,
        "import resource as r\n"
        "[r.getrlimit(x)[0] for x in (r.RLIMIT_FSIZE, r.RLIMIT_NOFILE, r.RLIMIT_CORE)]",
    )
    assert limits == f"[{64 << 20}, 1024, 0]"
    too_big = await run_ok(
        sandbox,
        "import errno\n"
        "try:\n"
        "    with open('big', 'wb') as f: f.write(b'x' * (65 << 20))\n"
        "    r = 'written'\n"
        "except OSError as e:\n"
        "    r = errno.errorcode[e.errno]\n"
        "r",
    )
    assert too_big == "'EFBIG'"


DAEMON = """
import os, subprocess, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp('sleep', ['sleep', '{seconds}'])
    os._exit(0)
"""


async def test_daemonized_child_does_not_outlive_the_session(backend: Backend) -> None:
    sb = await backend.create(small_spec())
    seconds = f"{9000 + uuid.uuid4().int % 900}.{uuid.uuid4().int % 10**6}"
    ex = await sb.execute(DAEMON.format(seconds=seconds))
    assert ex.ok, ex.error
    await asyncio.sleep(0.5)
    assert host_processes_with(seconds), "the daemon should be running while the session lives"
    await sb.close()
    await asyncio.sleep(0.5)
    assert host_processes_with(seconds) == []


async def test_daemonized_child_does_not_outlive_a_kernel_restart(sandbox: Sandbox) -> None:
    seconds = f"{9000 + uuid.uuid4().int % 900}.{uuid.uuid4().int % 10**6}"
    assert (await sandbox.execute(DAEMON.format(seconds=seconds))).ok
    await asyncio.sleep(0.5)
    assert host_processes_with(seconds)
    await sandbox.restart()
    await asyncio.sleep(0.5)
    assert host_processes_with(seconds) == []


async def test_sessions_cannot_see_each_other(backend: Backend) -> None:
    async with await backend.create(small_spec()) as a, await backend.create(small_spec()) as b:
        await a.upload("secret-of-a.txt", b"a's")
        marker = f"{9000 + uuid.uuid4().int % 900}.{uuid.uuid4().int % 10**6}"
        await a.execute(f"import subprocess; p = subprocess.Popen(['sleep', '{marker}'])")
        a_kernel = str(a.dirs.kernel)  # type: ignore[attr-defined]
        code = (
            "import glob, os, socket\n"
            "def reach(path):\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n"
            "        s.connect(path); return True\n"
            "    except OSError:\n"
            "        return False\n"
            f"sockets = [reach(f'{a_kernel}/k1-{{i}}') for i in range(1, 6)]\n"
            "cmdlines = [open(p, 'rb').read() for p in glob.glob('/proc/[0-9]*/cmdline')]\n"
            "found = []\n"
            "for top, dirs, files in os.walk('/'):\n"
            "    if top in ('/proc', '/sys', '/usr', '/dev'):\n"
            "        dirs.clear(); continue\n"
            "    found += [top for f in files if f == 'secret-of-a.txt']\n"
            f"(any(b'{marker}' in c for c in cmdlines), found, len(cmdlines) < 20, any(sockets))"
        )
        assert os.path.exists(f"{a_kernel}/k1-1")  # A's socket is there, on the host
        assert await run_ok(b, code) == "(False, [], True, False)"


async def test_the_kernel_directory_cannot_be_tampered_with(sandbox: Sandbox) -> None:
    ex = await sandbox.execute(
        "import os\n"
        "def attempt(f):\n"
        "    try:\n"
        "        f(); return 'done'\n"
        "    except OSError:\n"
        "        return 'refused'\n"
        "sockets = sorted(n for n in os.listdir('/run/kernel') if n.startswith('k'))\n"
        "[attempt(lambda: os.mkfifo('/run/kernel/conn-2.json')),\n"
        " attempt(lambda: open('/run/kernel/junk', 'w').write('x' * 1000)),\n"
        " attempt(lambda: os.unlink('/run/kernel/' + sockets[0]))]"
    )
    assert ex.ok, ex.error
    if os.geteuid() == 0:  # the sandbox runs as another uid than the directory's owner
        assert ex.text == "['refused', 'refused', 'refused']"
    # Whatever was planted is cleared before the next kernel: the restart cannot hang.
    await asyncio.wait_for(sandbox.restart(), 60)
    assert (await sandbox.execute("1 + 1")).text == "2"


# x86-64 numbers: io_uring_setup, userfaultfd, perf_event_open, keyctl, add_key, unshare, bpf,
# mount, init_module, kexec_load, ptrace.
DANGEROUS_CALLS = (
    "calls = {'io_uring_setup': (425, 8, None), 'userfaultfd': (323, 1),\n"
    "         'perf_event_open': (298, None, 0, -1, -1, 0), 'keyctl': (250, 0, -3, 1),\n"
    "         'add_key': (248, b'user', b'k', b'v', 1, -3), 'unshare': (272, 0x20000),\n"
    "         'bpf': (321, 0, None, 0), 'mount': (165, b'none', b'/tmp', b'tmpfs', 0, None),\n"
    "         'init_module': (175, None, 0, b''), 'kexec_load': (246, 0, 0, None, 0),\n"
    "         'ptrace': (101, 16, 1, None, None)}\n"
)


async def test_dangerous_system_calls_are_refused(sandbox: Sandbox) -> None:
    code = (
        "import ctypes, errno, platform\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n" + DANGEROUS_CALLS + "def outcome(args):\n"
        "    ctypes.set_errno(0)\n"
        "    r = libc.syscall(*args)\n"
        "    return errno.errorcode.get(ctypes.get_errno(), 'OK') if r == -1 else 'allowed'\n"
        "platform.machine(), {name: outcome(args) for name, args in calls.items()}"
    )
    machine, outcomes = eval(await run_ok(sandbox, code))
    if machine != "x86_64":
        pytest.skip("the system call numbers above are x86-64's")
    refused = {name: r for name, r in outcomes.items() if r in ("EPERM", "ENOSYS")}
    assert refused == outcomes, {n: r for n, r in outcomes.items() if n not in refused}
    # What the kernel's own work needs still runs: threads, subprocesses, numpy, pandas.
    work = await run_ok(
        sandbox,
        "import subprocess, threading, numpy as np, pandas as pd\n"
        "box = []\n"
        "t = threading.Thread(target=lambda: box.append(int(np.arange(10).sum()))); t.start()\n"
        "t.join()\n"
        "out = subprocess.run(['sh', '-c', 'echo $((6*7))'], capture_output=True, text=True)\n"
        "(box[0], out.stdout.strip(), int(pd.Series([1, 2]).sum()))",
    )
    assert work == "(45, '42', 3)"


async def test_shared_memory_is_size_capped(sandbox: Sandbox) -> None:
    code = (  # files of 8 MiB, each below the file-size limit: only the size cap can stop them
        "import errno, glob, os\n"
        "try:\n"
        "    for i in range(40):\n"
        "        with open(f'/dev/shm/fill-{i}', 'wb') as f: f.write(b'x' * (8 << 20))\n"
        "    r = 'filled'\n"
        "except OSError as e:\n"
        "    r = errno.errorcode[e.errno]\n"
        "for p in glob.glob('/dev/shm/fill-*'): os.unlink(p)\n"
        "r"
    )
    assert await run_ok(sandbox, code) == "'ENOSPC'"
