#!/usr/bin/env bash
# Debian packages the lab and the tests need. Idempotent: installs only what is missing.
# pigz: each lab host's dockerd unpacks an image's gzip layers with unpigz when it is on PATH (moby's
# pkg/archive), else with Go's gzip: the real vLLM's image (2.9 GB) pulled on a lab host in 30 s
# against 40 s on this machine's kind, and every lab test and `make demo` pull it.
set -euo pipefail
pkgs=(openssh-server openssh-client docker.io debootstrap docker-registry rsync sudo iproute2
      iputils-ping procps ethtool python3-venv netplan.io nftables pigz)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) != 0 ]]; then echo "sparkprov: need root to install: ${missing[*]}" >&2; exit 1; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
