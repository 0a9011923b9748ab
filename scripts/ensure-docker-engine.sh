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

# Writes the runsc entry into daemon.json, keeping every other setting; prints "changed" when
# it had to change the file.
register_runsc() {
    local runsc
    runsc="$(command -v runsc)"
    mkdir -p "$(dirname "$daemon_json")"
    python3 - "$daemon_json" "$runsc" "$runsc_args" <<'EOF'
import json, os, sys
path, runsc, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    with open(path) as f:
        config = json.load(f) if os.path.getsize(path) else {}
except FileNotFoundError:
    config = {}
wanted = {"path": runsc, "runtimeArgs": args}
if config.get("runtimes", {}).get("runsc") != wanted:
    config.setdefault("runtimes", {})["runsc"] = wanted
    with open(path + ".tmp", "w") as f:
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
    if $want_runsc && { [ "$(register_runsc)" = changed ] || ! engine_has_runsc; }; then
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
    register_runsc >/dev/null
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
