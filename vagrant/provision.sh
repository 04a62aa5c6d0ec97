#!/bin/sh
# Provision one Vagrant VM as a simulated DGX Spark (see Vagrantfile). Idempotent.
# $1: host name (spark1), $2: index (1). Stand-ins come from /sparkprov-standins.
set -eu
name=$1; index=$2
S=/sparkprov-standins
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends openssh-server sudo docker.io iproute2 \
  python3 >/dev/null

# ConnectX-7 names for the rail NICs (matched by the MACs the Vagrantfile gives them)
cat > /etc/systemd/network/10-sparklab-r1.link <<LINK
[Match]
MACAddress=4c:bb:47:0$index:91:01
[Link]
Name=enp1s0f1np1
LINK
cat > /etc/systemd/network/10-sparklab-r2.link <<LINK
[Match]
MACAddress=4c:bb:47:0$index:91:03
[Link]
Name=enP2p1s0f1np1
LINK
# the uncabled twins: veths whose peer stays down (admin up, no carrier), at every boot
cat > /usr/local/sbin/sparklab-dark-twins <<'SH'
#!/bin/sh
for pair in enp1s0f0np0:sl-dark0 enP2p1s0f0np0:sl-dark1; do
  ifn=${pair%%:*}; peer=${pair#*:}
  ip link show "$ifn" >/dev/null 2>&1 || ip link add name "$ifn" type veth peer name "$peer"
  ip link set "$ifn" up
done
SH
chmod 755 /usr/local/sbin/sparklab-dark-twins
cat > /etc/systemd/system/sparklab-dark-twins.service <<'UNIT'
[Unit]
Description=sparkprov lab: uncabled ConnectX-7 twins
After=network-pre.target
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/sparklab-dark-twins
[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable --now sparklab-dark-twins.service
# .link files apply from the next boot; rename the rail NICs now too
for pair in 91:01:enp1s0f1np1 91:03:enP2p1s0f1np1; do
  want=${pair#*:*:}; m="4c:bb:47:0$index:${pair%:*}"
  cur=$(ip -o link | awk -v m="$m" '$0 ~ m {sub(":","",$2); sub("@.*","",$2); print $2}')
  if [ -n "$cur" ] && [ "$cur" != "$want" ]; then
    ip link set "$cur" down; ip link set "$cur" name "$want"
  fi
  [ -n "$cur" ] && ip link set "$want" up
done

# GB10 stand-ins (the same files the namespace lab installs)
for f in nvidia-smi ibdev2netdev nvidia-container-runtime-hook nvidia-ctk; do
  install -m 755 "$S/$f" /usr/local/bin/$f
done
install -m 644 "$S/dgx-release" /etc/dgx-release
mkdir -p /etc/sparkprov-lab
[ -f /etc/sparkprov-lab/gpu.conf ] || printf 'DRIVER_VERSION=580.95.05\nCUDA_VERSION=13.0\nGPU_UUID=GPU-%s\nTEMP_C=40\nPOWER_W=11.37\n' \
  "$(cat /proc/sys/kernel/random/uuid)" > /etc/sparkprov-lab/gpu.conf

# user nvidia: sudo with a password, docker group exists but nvidia is not in it
getent group docker >/dev/null || groupadd docker
if ! id nvidia >/dev/null 2>&1; then
  useradd -m -s /bin/bash -G adm,cdrom,sudo,dip,plugdev,video nvidia
  pw=$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')
  echo "nvidia:$pw" | chpasswd
  echo "$pw" > /root/become_password; chmod 600 /root/become_password
  echo "sparklab: $name: sudo password of nvidia: $pw (also in /root/become_password)"
fi
install -d -m 700 -o nvidia -g nvidia /home/nvidia/.ssh
# the vagrant user's key also logs in as nvidia (vagrant ssh-config gives the key path)
install -m 600 -o nvidia -g nvidia /home/vagrant/.ssh/authorized_keys \
  /home/nvidia/.ssh/authorized_keys

# docker: the lab registry on the host side of the management network
mkdir -p /etc/docker
cat > /etc/docker/daemon.json <<'JSON'
{"registry-mirrors": ["http://10.77.0.1:5000"], "insecure-registries": ["10.77.0.1:5000"]}
JSON
systemctl restart docker
