#!/usr/bin/env bash
# Debian packages the lab and the tests need. Idempotent: installs only what is missing.
set -euo pipefail
pkgs=(openssh-server openssh-client docker.io debootstrap docker-registry rsync sudo iproute2
      iputils-ping procps ethtool python3-venv netplan.io nftables)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) != 0 ]]; then echo "sparkprov: need root to install: ${missing[*]}" >&2; exit 1; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
