#!/usr/bin/env bash
# Makes sure a Docker engine answers. When none does and we may start one (root, dockerd
# installed), start it the way these machines need: no bridge, so containers get only `lo`.
# Exits non-zero when no engine can be had.
set -euo pipefail
docker info >/dev/null 2>&1 && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v dockerd >/dev/null; then
    echo "no Docker engine answers, and this script cannot start one (needs root and dockerd)" >&2
    exit 1
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
