#!/usr/bin/env bash
# Installs the Debian packages the project needs: bubblewrap for the local sandbox, a system
# Python with venv, make; redis-server for cluster mode's shared store and its tests (started
# by each test on a free port: the system service the package starts is stopped and disabled
# when this script installed it); docker.io and debootstrap for the Docker backend and its
# images, runsc (gVisor, an optional stronger runtime for it: docs/gvisor.md); the programs
# commands in a local sandbox find on the host (git, ps, and nsenter to enter it); ip, with
# which the egress tests list the host's own addresses; the other
# languages' kernels the local backend runs (R with IRkernel, a JDK for jjava; Deno and jjava
# themselves come from PyPI with `make install`), without their recommendations (R's would
# bring a compiler tool chain); Chromium and its WebDriver for the console's browser tests
# (tests/orchestrator/governance/test_console_browser.py); QEMU and a static busybox for the
# microvm backend with e2fsprogs to make its disks (docs/microvm.md; its guest kernel comes with
# `make install`, never installed on this host), also without recommendations; e2fsprogs makes
# volumes' images too (docs/volumes.md).
# Safe to run again: it installs only what is missing.
set -euo pipefail
packages=(bubblewrap python3 python3-venv python3-dev make docker.io runsc debootstrap git procps
    util-linux iproute2 redis-server chromium chromium-driver)
language_packages=(r-base-core r-cran-irkernel default-jdk-headless qemu-system-x86 e2fsprogs
    busybox-static)

missing_of() {
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
    done
}
mapfile -t missing < <(missing_of "${packages[@]}")
mapfile -t missing_languages < <(missing_of "${language_packages[@]}")
if ((${#missing[@]} + ${#missing_languages[@]})); then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    if ((${#missing[@]})); then
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
        if [[ " ${missing[*]} " == *" redis-server "* ]]; then
            # Nothing here uses a Redis on the default port: stop the one the package started.
            $sudo systemctl disable --now redis-server 2>/dev/null \
                || $sudo service redis-server stop 2>/dev/null || true
        fi
    fi
    if ((${#missing_languages[@]})); then
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            "${missing_languages[@]}"
    fi
fi
