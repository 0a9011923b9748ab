"""Code that tries to get out, or to look at what is not its own."""

from __future__ import annotations

import os

from sandbox import Sandbox


async def test_ptrace_reaches_nothing_outside(sandbox: Sandbox) -> None:
    host_pid = os.getpid()  # the orchestrator, as the host numbers it
    ex = await sandbox.execute(
        "import ctypes, errno\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "PTRACE_ATTACH = 16\n"
        f"r = libc.ptrace(PTRACE_ATTACH, {host_pid}, None, None)\n"
        "(r, errno.errorcode.get(ctypes.get_errno()))"
    )
    assert ex.ok, ex.error
    assert ex.text is not None and ex.text.startswith("(-1, ")


async def test_no_device_or_kernel_interface_to_abuse(sandbox: Sandbox) -> None:
    ex = await sandbox.execute(
        "import os\n"
        "sorted(set(os.listdir('/dev')) - {'null', 'zero', 'full', 'random', 'urandom', 'tty',"
        " 'pts', 'ptmx', 'shm', 'mqueue', 'fd', 'stdin', 'stdout', 'stderr', 'core', 'console'})"
    )
    assert ex.text == "[]", ex.text
    sysrq = await sandbox.execute(
        "def w(p):\n"
        "    try:\n"
        "        open(p, 'w').write('1'); return 'written'\n"
        "    except OSError:\n"
        "        return 'refused'\n"
        "targets = ['/proc/sysrq-trigger', '/proc/sys/kernel/hostname',\n"
        "           '/sys/kernel/uevent_helper']\n"
        "[w(p) for p in targets]"
    )
    assert sysrq.text == "['refused', 'refused', 'refused']"
