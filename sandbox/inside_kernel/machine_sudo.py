#!/opt/kernel/bin/python3 -I
"""`sudo` in a gVisor machine: runs a command as the machine's root by asking its agent
(machine_root.py), since gVisor keeps a setuid program from gaining rights. Bound over the
image's `sudo` (/usr/local/bin/sudo) in machines only.

Takes what agents write: `sudo [-n] [-E] [-H] [-S] [-k] [-u root] [--] COMMAND [ARGS...]`,
`sudo -i`/`-s` (a root shell) and `sudo sh -c '...'`. The command runs on this process's own
stdin, stdout and stderr; Ctrl-C and other signals sent here are passed on to it; its exit status
is this one's. The environment goes with it (as `sudo -E`, so the egress proxy's variables do),
with root's HOME, USER and LOGNAME.
"""

import array
import contextlib
import json
import os
import signal
import socket
import sys

SOCKET = "/run/cir/root.sock"
_FLAGS = {"-n", "-E", "-H", "-S", "-k", "-b", "--non-interactive", "--preserve-env"}
_SHELL = ["/bin/bash", "-l"]


def _command(argv: list[str]) -> list[str]:
    args = list(argv)
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "--":
            break
        if flag in ("-u", "--user"):
            user = args.pop(0) if args else ""
            if user not in ("root", "0", "#0"):
                sys.exit(f"sudo: only root is offered here, not {user!r}")
        elif flag in ("-i", "-s", "--login", "--shell"):
            return _SHELL + (["-c", " ".join(args)] if args else [])
        elif flag.startswith("--preserve-env=") or flag in _FLAGS:
            continue
        elif flag in ("-h", "--help", "-V", "--version"):
            print("sudo (code-interpreter machine): runs COMMAND as the machine's root")
            sys.exit(0)
        else:
            sys.exit(f"sudo: option {flag} is not offered here; run `sudo COMMAND ...`")
    if not args:
        sys.exit("usage: sudo [-n] [-E] [-u root] COMMAND [ARGS...]")
    return args


def main() -> int:
    argv = _command(sys.argv[1:])
    if os.geteuid() == 0:  # root already: no need to ask
        os.execvp(argv[0], argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
    except OSError as exc:
        sys.exit(f"sudo: the machine's root cannot be reached ({exc})")
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    payload = json.dumps(request).encode() + b"\n"
    fds = array.array("i", [0, 1, 2])
    conn.sendmsg([payload[:65536]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
    if len(payload) > 65536:
        conn.sendall(payload[65536:])

    def forward(number: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(f"signal {number}\n".encode())

    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), forward)
    said = b""
    while b"\n" not in said:
        try:
            chunk = conn.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        said += chunk
    word, _, value = said.decode(errors="replace").strip().partition(" ")
    if word == "exit" and value.isdigit():
        return int(value)
    if word == "signal" and value.isdigit():
        return 128 + int(value)
    sys.stderr.write(f"sudo: {said.decode(errors='replace').strip() or 'no answer from root'}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
