#!/usr/bin/env bash
# Installs the Debian packages the project needs: bubblewrap for the local sandbox, a system
# Python with venv, make; docker.io and debootstrap for the Docker backend and its images; the
# programs commands in a local sandbox find on the host (git, ps, and nsenter to enter it).
# Safe to run again: it installs only what is missing.
set -euo pipefail
packages=(bubblewrap python3 python3-venv python3-dev make docker.io debootstrap git procps util-linux)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
