#!/usr/bin/env bash
# Makes sure a Docker engine answers. When none does and we may start one (root, dockerd
# installed), start it the way these machines need: no bridge, so containers get only `lo`.
# Where gVisor is installed (`runsc`) and we are root, it is registered with the engine as the
# runtime `runsc` (docs/gvisor.md), merged into /etc/docker/daemon.json; an engine already
# running that lacks it is told to reload its configuration (SIGHUP: containers keep running).
# Exits non-zero when no engine can be had.
set -euo pipefail
daemon_json=/etc/docker/daemon.json
# --network=none: runsc refuses to run in the root network namespace our engine gives
#   containers (--bridge=none, network_mode=none) otherwise; the sandbox's netstack stays
#   empty but for lo.
# --host-uds=all: the kernel's ZeroMQ ipc sockets live on a bind mount and are reached from
#   the host, and code inside connects to host-made sockets (host tools, egress).
# --platform=ptrace: works everywhere, nested virtualisation included (KVM is not always there).
# No --oci-seccomp: gVisor's own kernel is the syscall wall, and loading our profile inside it
#   breaks libzmq's threads in Debian's release (docs/gvisor.md).
runsc_args='["--network=none", "--host-uds=all", "--platform=ptrace"]'

engine_has_runsc() {
    docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'
}

# Adds the runsc entry to daemon.json when it has none, keeping every other setting and the
# file's mode and owner; prints "changed" when it added it. An entry of the operator's own is
# kept (a warning names the arguments our sandboxes need that it lacks); a file that is not a
# JSON object is named and left alone (non-zero exit).
register_runsc() {
    local runsc
    runsc="$(command -v runsc)"
    mkdir -p "$(dirname "$daemon_json")"
    python3 - "$daemon_json" "$runsc" "$runsc_args" <<'EOF'
import json, os, sys
path, runsc, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    with open(path) as f:
        text = f.read()
    info = os.stat(path)
except FileNotFoundError:
    text, info = "", None
try:
    config = json.loads(text) if text.strip() else {}
except json.JSONDecodeError as exc:
    sys.exit(f"error: {path} is not valid JSON ({exc}): gVisor (runsc) is not registered")
if not isinstance(config, dict) or not isinstance(config.get("runtimes", {}), dict):
    sys.exit(f"error: {path} must be a JSON object, its 'runtimes' an object: runsc is not registered")
entry = config.get("runtimes", {}).get("runsc")
if entry is not None:
    given = entry.get("runtimeArgs", []) if isinstance(entry, dict) else []
    lacking = [arg for arg in args[:2] if arg not in given]  # the platform is the operator's
    if lacking:
        print(f"warning: the runsc entry of {path} lacks {' '.join(lacking)}, which the "
              "sandboxes need (docs/gvisor.md); it is left as it is", file=sys.stderr)
    sys.exit(0)
config.setdefault("runtimes", {})["runsc"] = {"path": runsc, "runtimeArgs": args}
mode = info.st_mode & 0o7777 if info else 0o644
fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
with os.fdopen(fd, "w") as f:
    os.fchmod(f.fileno(), mode)
    if info:
        os.fchown(f.fileno(), info.st_uid, info.st_gid)
    json.dump(config, f, indent=2)
    f.write("\n")
os.replace(path + ".tmp", path)
print("changed")
EOF
}

want_runsc=false
if [ "$(id -u)" -eq 0 ] && command -v runsc >/dev/null; then
    want_runsc=true
fi

if docker info >/dev/null 2>&1; then
    registered=unchanged
    if $want_runsc; then
        registered="$(register_runsc)" || registered=failed
    fi
    if $want_runsc && [ "$registered" != failed ] && { [ "$registered" = changed ] || ! engine_has_runsc; }; then
        pid="$(pgrep -o -x dockerd || true)"
        if [ -z "$pid" ]; then
            echo "warning: runsc registered in $daemon_json, but no local dockerd to reload" >&2
            exit 0
        fi
        echo "registering gVisor (runsc) with the running engine (SIGHUP to dockerd $pid)" >&2
        kill -HUP "$pid"
        for _ in $(seq 40); do
            engine_has_runsc && exit 0
            sleep 0.5
        done
        echo "warning: the engine did not list runsc after reloading $daemon_json" >&2
    fi
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v dockerd >/dev/null; then
    echo "no Docker engine answers, and this script cannot start one (needs root and dockerd)" >&2
    exit 1
fi
if $want_runsc; then
    register_runsc >/dev/null || true  # named above; dockerd says the rest
fi
log="${TMPDIR:-/tmp}/code-interpreter-dockerd.log"
echo "starting dockerd (log: $log)" >&2
nohup dockerd --bridge=none --iptables=false --ip-masq=false >"$log" 2>&1 &
for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && exit 0
    sleep 0.5
done
echo "dockerd did not come up; the end of its log:" >&2
tail -20 "$log" >&2
exit 1
