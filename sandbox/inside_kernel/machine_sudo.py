#!/opt/kernel/bin/python3 -I
"""`sudo` in a gVisor machine: runs a command as the machine's root by asking its agent
(machine_root.py), since gVisor keeps a setuid program from gaining rights. Bound over the
image's `sudo` (/usr/local/bin/sudo) in machines only.

Takes what agents write: `sudo [-n] [-E] [-H] [-S] [-k] [-u root] [--] [NAME=VALUE...] COMMAND
[ARGS...]` (flags joined or apart), `sudo -i`/`-s` (a root shell), `sudo sh -c '...'`, `sudo -v`
and `-l`. The command runs on this process's own stdin, stdout and stderr, in a session of its
own (no controlling terminal); Ctrl-C and other signals sent here are passed on to it; its exit
status is this one's. The environment goes with it (as `sudo -E`, so the egress proxy's
variables do), with root's HOME, USER and LOGNAME, less what points the user's installs at the
workspace (machine_root.root_environment: root installs into the image); a `NAME=VALUE` given
here is kept as given.
"""

import array
import contextlib
import errno
import json
import os
import shlex
import signal
import socket
import sys

SOCKET = "/run/cir/root.sock"
TURNED_OFF = "/run/cir/root-off"  # machine_root.py's
_FLAGS = {"-n", "-E", "-H", "-S", "-k", "-b", "--non-interactive", "--preserve-env"}
_SHELL = ["/bin/bash", "-l"]


def _flags(args: list[str]) -> list[str]:
    """Leading options one at a time: `-nE` as `-n -E`, `-uroot` and `--user=root` as
    `-u root`."""
    out: list[str] = []
    while args and args[0].startswith("-") and args[0] != "-":
        flag = args.pop(0)
        if flag == "--":
            out.append(flag)
            break
        if flag.startswith("--"):
            name, equals, value = flag.partition("=")
            out += [name, value] if equals and name == "--user" else [flag]
            continue
        letters = flag[1:]
        while letters:
            letter, letters = letters[0], letters[1:]
            out.append("-" + letter)
            if letter == "u":
                out.append(letters or (args.pop(0) if args else ""))
                letters = ""
    return out + args


def _command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command to run and the variables set before it (`sudo NAME=VALUE cmd`)."""
    args = _flags(list(argv))
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "--":
            break
        if flag in ("-u", "--user"):
            user = args.pop(0) if args else ""
            if user not in ("root", "0", "#0"):
                sys.exit(f"sudo: only root is offered here, not {user!r}")
        elif flag in ("-i", "-s", "--login", "--shell"):
            return _SHELL + (["-c", shlex.join(args)] if args else []), {}
        elif flag in ("-v", "--validate", "-k", "-K", "--reset-timestamp", "--remove-timestamp"):
            if not args:
                sys.exit(0)  # nothing to validate or forget: root is given without a password
        elif flag in ("-l", "--list"):
            print("User may run the following commands as root: ALL (NOPASSWD)")
            sys.exit(0)
        elif flag.startswith("--preserve-env=") or flag in _FLAGS:
            continue
        elif flag in ("-h", "--help", "-V", "--version"):
            print("sudo (code-interpreter machine): runs COMMAND as the machine's root")
            sys.exit(0)
        else:
            sys.exit(f"sudo: option {flag} is not offered here; run `sudo COMMAND ...`")
    assigned: dict[str, str] = {}
    while args and "=" in args[0] and not args[0].startswith("="):
        name, _, value = args.pop(0).partition("=")
        if not name.replace("_", "a").isalnum():
            args.insert(0, f"{name}={value}")
            break
        assigned[name] = value
    if not args:
        sys.exit("usage: sudo [-n] [-E] [-u root] [NAME=VALUE...] COMMAND [ARGS...]")
    return args, assigned


def main() -> int:
    argv, assigned = _command(sys.argv[1:])
    env = {**os.environ, **assigned}
    if os.geteuid() == 0:  # root already: no need to ask
        os.execvpe(argv[0], argv, env)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
    except OSError as exc:
        if os.path.exists(TURNED_OFF):
            sys.exit(
                "sudo: root is turned off in this service's machines (the operator's "
                "CODE_INTERPRETER_GVISOR_ROOT=false): run it as the sandbox's user (pip install "
                "and npm i -g work so, into the workspace), or ask the operator"
            )
        sys.exit(f"sudo: the machine's root cannot be reached ({exc})")
    request = {"argv": argv, "cwd": os.getcwd(), "env": env, "assigned": sorted(assigned)}
    payload = json.dumps(request).encode() + b"\n"
    fds = array.array("i", [0, 1, 2])
    try:
        sent = conn.sendmsg(
            [payload[:65536]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())]
        )
        conn.sendall(payload[sent:])
    except OSError as exc:  # refused before it was all read: its answer says why
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
            sys.exit(f"sudo: the machine's root cannot be asked ({exc})")

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
