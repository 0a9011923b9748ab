"""Root in a gVisor machine (docs/gvisor.md): a process asked as root, or the sandbox's user
through sudo, installs into the machine's own root filesystem (an overlay in its memory): a
package built here goes in with dpkg, the kernel (still unprivileged) sees it, a whole pause
keeps it, and neither another machine of the image nor the shared export sees a byte of it."""

from __future__ import annotations

import signal

import pytest

from code_interpreter_wire.errors import RootUnavailable
from code_interpreter_wire.processes import ProcessRequest
from sandbox import create_backend
from sandbox.backends.gvisor.backend import GvisorBackend
from tests.conftest import small_spec

# A Debian package made in the sandbox, as an agent's `apt-get install` would fetch one.
BUILD_DEB = (
    "set -e; mkdir -p pkg/DEBIAN pkg/usr/local/share/cirdemo; "
    "printf 'Package: cirdemo\\nVersion: 1.0\\nArchitecture: all\\nMaintainer: t <t@example.org>\\n"
    "Description: demo\\n' > pkg/DEBIAN/control; "
    "echo installed > pkg/usr/local/share/cirdemo/hello; dpkg-deb --build pkg cirdemo.deb"
)


async def run(sandbox: object, command: str, *, root: bool = False) -> tuple[int | None, str]:
    done = await sandbox.run_command(  # type: ignore[attr-defined]
        ProcessRequest(command=command, user="root" if root else None, timeout_s=120)
    )
    return done.exit_code, done.stdout + done.stderr


async def test_root_installs_into_the_machines_own_root(gvisor: GvisorBackend) -> None:
    sb = await gvisor.create(small_spec())
    other = await gvisor.create(small_spec())
    woken = None
    try:
        assert await run(sb, "id -u && echo made > /usr/local/bin/made-here", root=True) == (
            0,
            "0\n",
        )
        code, said = await run(sb, "id -u; touch /usr/local/bin/not-mine")
        assert code != 0 and not said.startswith("0\n") and "Permission denied" in said
        # The sandbox's user through sudo, as agents write `sudo apt-get install ...`.
        assert await run(sb, "sudo -n id -u") == (0, "0\n")
        code, said = await run(sb, BUILD_DEB)
        assert code == 0, said
        code, said = await run(sb, "sudo -n dpkg -i cirdemo.deb && dpkg -s cirdemo")
        assert code == 0 and "Status: install ok installed" in said, said
        seen = await sb.execute(
            "import os; os.getuid() != 0, open('/usr/local/share/cirdemo/hello').read()"
        )
        assert seen.text == "(True, 'installed\\n')", seen
        # Not a byte of it outside this machine.
        assert await run(other, "test -e /usr/local/bin/made-here; echo $?") == (0, "1\n")
        assert not list(gvisor.rootfs_store.glob("*/rootfs/usr/local/bin/made-here"))
        assert not list(gvisor.rootfs_store.glob("*/rootfs/usr/local/share/cirdemo"))
        # A whole pause keeps the machine's root filesystem with its memory.
        handle = await sb.suspend()
        assert handle is not None
        woken = await gvisor.wake(handle, sb.spec)
        assert await run(woken, "cat /usr/local/share/cirdemo/hello") == (0, "installed\n")
    finally:
        await other.close()
        await (woken or sb).close()
        if woken is not None:
            await sb.close()


# A client of the agent's root socket that breaks its rules: no descriptors, too much, and
# signal lines no signal is (which must not end the agent: it is the machine's first process).
RUDE_CLIENTS = """
import socket, time
def ask(payload, fds=()):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/run/cir/root.sock")
    if fds:
        socket.send_fds(s, [payload], list(fds))
    else:
        s.sendall(payload)
    return s
def answer(s):
    said = s.recv(4096).decode()
    s.close()
    return said.strip()
print(answer(ask(b'{"argv": ["id"]}\\n')))
print(answer(ask(b"x" * 300_000)))
s = ask(b'{"argv": ["sleep", "1"]}\\n', fds=(0, 1, 2))
s.sendall(b"signal 99999999999\\nsignal \\xc2\\xb2\\nsignal -9\\nsignal x\\n")
print(answer(s))
"""
# Ctrl-C to sudo itself (not to its command's group, which the service's signal reaches too):
# sudo must pass it on, and the command's trap answer it.
FORWARDED = """
sudo sh -c 'trap "echo got-int; exit 7" INT; echo ready; while :; do sleep 0.1; done' > /tmp/out &
pid=$!
for i in $(seq 200); do grep -q ready /tmp/out && break; sleep 0.1; done
kill -INT $pid
wait $pid
echo "rc=$?"
cat /tmp/out
"""


async def test_sudo_passes_signals_on_and_its_askers_cannot_break_the_agent(
    gvisor: GvisorBackend,
) -> None:
    sb = await gvisor.create(small_spec())
    try:
        # Ctrl-C to sudo reaches its command, whose end is sudo's.
        sleeper = await sb.start_process(ProcessRequest(command="sudo sleep 300"))
        started = (
            "for i in $(seq 100); do pgrep -f '^sleep 300$' && exit 0; sleep 0.1; done; exit 1"
        )
        assert (await run(sb, started))[0] == 0
        await sleeper.signal(signal.SIGINT)
        end = await sleeper.wait()
        assert end.exit_code == 128 + signal.SIGINT or end.signal == signal.SIGINT, end
        # sudo killed outright: its command goes with it.
        sleeper = await sb.start_process(ProcessRequest(command="exec sudo sleep 301"))
        assert (await run(sb, started.replace("300", "301")))[0] == 0
        await sleeper.signal(signal.SIGKILL)
        await sleeper.wait()
        gone = "for i in $(seq 100); do pgrep -f '^sleep 301$' || exit 0; sleep 0.1; done; exit 1"
        assert (await run(sb, gone))[0] == 0
        rude = await sb.run_command(ProcessRequest(argv=["python3", "-c", RUDE_CLIENTS]))
        assert rude.exit_code == 0, rude
        assert rude.stdout.splitlines() == [
            "refused: ValueError: send stdin, stdout and stderr with the request",
            "refused: the request is too large",
            "exit 0",
        ]
        # Outside the service's own process marker, so only sudo's forwarding can deliver it.
        forwarded = await sb.run_command(
            ProcessRequest(argv=["env", "-u", "CODE_INTERPRETER_PROCESS", "sh", "-c", FORWARDED])
        )
        assert forwarded.stdout.split() == ["rc=7", "ready", "got-int"], forwarded
        # sudo as agents write it: a variable before the command, flags joined.
        assert await run(sb, "sudo -nE GREETING=hi sh -c 'echo $GREETING $(id -u)'") == (
            0,
            "hi 0\n",
        )
        assert await run(sb, "sudo -n id -u") == (0, "0\n")  # the agent serves on
    finally:
        await sb.close()


async def test_root_turned_off_by_the_operator_is_refused_saying_so(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`root=False` (CODE_INTERPRETER_GVISOR_ROOT=false): `user: root` is refused, typed, and
    the machine's sudo says why; the agent is told at its hello, as a restored one is."""
    state = tmp_path_factory.mktemp("gv-no-root", numbered=True)
    backend = create_backend("gvisor", state_dir=state, templates=False, root=False)
    sb = await backend.create(small_spec())
    try:
        with pytest.raises(RootUnavailable, match="CODE_INTERPRETER_GVISOR_ROOT=false"):
            await run(sb, "id -u", root=True)
        code, said = await run(sb, "sudo -n id -u")
        assert code == 1 and "root is turned off" in said and "ask the operator" in said, said
        # Nothing listens where sudo asks: no process of the machine reaches root another way.
        code, said = await run(sb, "test -e /run/cir/root.sock; echo $?")
        assert (code, said) == (0, "1\n")
        code, said = await run(sb, "id -u")
        assert code == 0 and said.strip().isdigit() and said.strip() != "0", said
    finally:
        await sb.close()
        await backend.close()
