"""The simulated Spark hosts: isolation, ssh, sudo, fabric, stand-ins, docker, teardown."""
# Engine: none: no model is served in this module.
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
import yaml

from sparklab import faults, gb10, state

pytestmark = pytest.mark.lab

CAPTURED_HEADER = ("| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      "
                   "CUDA Version: 13.0     |")
CAPTURED_GPU_ROW = ("|   0  NVIDIA GB10                    On  |   0000000F:01:00.0 Off |"
                    "                  N/A |")
CAPTURED_TEMP_ROW = ("| N/A   40C    P0             11W /  N/A  | Not Supported          |"
                     "      0%      Default |")


def test_host_isolation(lab):
    a, b = "spark1", "spark2"
    try:
        assert lab.sh(a, "useradd -m isotest && echo x > /etc/isotest.conf && "
                         "echo y > /tmp/isotest && echo z > /var/lib/isotest && echo s > /srv/isotest && "
                         "mkdir -p /etc/netplan && echo n > /etc/netplan/99-isotest.yaml && "
                         "ip addr add 192.168.250.1/24 dev enp1s0f0np0").returncode == 0
        assert lab.sh(a, "id isotest && test -f /etc/isotest.conf && test -f /tmp/isotest "
                         "&& ip -br addr show enp1s0f0np0 | grep -q 192.168.250.1").returncode == 0
        for check in ("id isotest", "test -e /etc/isotest.conf", "test -e /tmp/isotest",
                      "test -e /var/lib/isotest", "test -e /home/isotest", "test -e /srv/isotest",
                      "test -e /etc/netplan/99-isotest.yaml",
                      "ip -br addr | grep -q 192.168.250.1"):
            assert lab.sh(b, check).returncode != 0, f"{check} leaked from {a} to {b}"
        # nor onto the control machine
        for p in ("/etc/isotest.conf", "/tmp/isotest", "/var/lib/isotest", "/home/isotest", "/srv/isotest"):
            assert subprocess.run(["test", "-e", p]).returncode != 0, p
        assert subprocess.run(["id", "isotest"], capture_output=True).returncode != 0
        assert "192.168.250.1" not in subprocess.run(["ip", "-br", "addr"], capture_output=True,
                                                     text=True).stdout
        # each host has its own hostname
        assert lab.exec(a, ["hostname"]).stdout.strip() == a
        assert lab.exec(b, ["hostname"]).stdout.strip() == b
    finally:
        lab.sh(a, "userdel -r isotest; rm -f /etc/isotest.conf /tmp/isotest /var/lib/isotest /srv/isotest "
                  "/etc/netplan/99-isotest.yaml; ip addr flush dev enp1s0f0np0")


def test_strict_host_keys(lab, tmp_path):
    r = lab.ssh("spark1", "hostname")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "spark1"
    # spark2's key written under spark1's address: refused
    lines = lab.known_hosts.read_text().splitlines()
    key2 = next(l for l in lines if l.startswith(lab.hosts["spark2"] + " ")).split(" ", 1)[1]
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{lab.hosts['spark1']} {key2}\n")
    r = lab.ssh("spark1", "hostname", known_hosts=wrong)
    assert r.returncode == 255
    assert "Host key verification failed" in r.stderr
    # an empty known_hosts with strict checking: refused too
    empty = tmp_path / "empty"
    empty.write_text("")
    r = lab.ssh("spark1", "hostname", known_hosts=empty)
    assert r.returncode == 255 and "Host key verification failed" in r.stderr
    # host keys differ between hosts
    keys = {l.split()[2] for l in lines}
    assert len(keys) == len(lab.hosts)


def test_root_login_and_passwords_refused(lab):
    r = subprocess.run(["ssh", "-i", str(lab.key), "-o", "BatchMode=yes",
                        "-o", "StrictHostKeyChecking=yes",
                        "-o", f"UserKnownHostsFile={lab.known_hosts}",
                        f"root@{lab.hosts['spark1']}", "true"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 255 and "Permission denied" in r.stderr


def test_sudo_needs_the_password(lab):
    assert (lab.password_file.stat().st_mode & 0o777) == 0o600
    r = lab.ssh("spark1", "sudo -k -n true")
    assert r.returncode != 0 and "password is required" in r.stderr
    r = lab.ssh("spark1", "sudo -k -S -p '' id -u", input=lab.password + "\n")
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr
    r = lab.ssh("spark1", "sudo -k -S -p '' id -u", input="wrong-password\n")
    assert r.returncode != 0
    r = lab.ssh("spark1", "id -nG")
    groups = set(r.stdout.split())
    assert {"sudo", "adm"} <= groups and "docker" not in groups
    assert lab.sh("spark1", "getent group docker").returncode == 0


def _ping_jumbo(lab, src: str, dst_ip: str) -> bool:
    lab.sh(src, "ip neigh flush all")
    return lab.sh(src, f"ping -c 1 -W 1 -M do -s 8972 {dst_ip}").returncode == 0


def test_ping_opens_datagram_sockets_as_on_dgx_os(lab):
    """DGX OS (systemd's 50-default.conf) lets users open ICMP datagram sockets. Without that,
    ping falls back to a raw socket, which gets a copy of every ICMP packet the host receives:
    the 16-host mesh check then lost replies and paid 2 s retries a Spark never pays."""
    probe = ("python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM, "
             "socket.IPPROTO_ICMP).close()'")
    for host in ("spark1", "spark2"):
        r = lab.ssh(host, probe)
        assert r.returncode == 0, f"{host}: {r.stderr}"


@pytest.mark.parametrize("rail,iface", sorted(state.RAIL_IFACES.items()))
def test_jumbo_frames_need_mtu_9000_on_both_ends(lab, rail, iface):
    ip1, ip2 = f"192.168.{99 + rail}.10", f"192.168.{99 + rail}.11"
    try:
        lab.sh("spark1", f"ip addr add {ip1}/24 dev {iface}")
        lab.sh("spark2", f"ip addr add {ip2}/24 dev {iface}")
        assert lab.sh("spark1", f"ping -c 1 -W 2 {ip2}").returncode == 0
        assert lab.exec("spark1", ["cat", f"/sys/class/net/{iface}/mtu"]).stdout.strip() == "1500"
        assert not _ping_jumbo(lab, "spark1", ip2)
        lab.sh("spark1", f"ip link set {iface} mtu 9000")
        assert not _ping_jumbo(lab, "spark1", ip2), "jumbo passed with one end at 1500"
        lab.sh("spark2", f"ip link set {iface} mtu 9000")
        assert _ping_jumbo(lab, "spark1", ip2)
        assert _ping_jumbo(lab, "spark2", ip1)
        faults.reset_mtu("spark2", iface, 1500)
        assert not _ping_jumbo(lab, "spark1", ip2)
    finally:
        for h in ("spark1", "spark2"):
            lab.sh(h, f"ip addr flush dev {iface}; ip link set {iface} mtu 1500")


def test_dark_twins_have_no_carrier(lab):
    for iface in state.DARK_IFACES:
        out = lab.exec("spark1", ["ip", "-br", "link", "show", iface]).stdout
        assert "NO-CARRIER" in out and " DOWN " in out
    assert lab.exec("spark1", ["cat", "/sys/class/net/enp1s0f1np1/mtu"]).stdout.strip() == "1500"


def test_ibdev2netdev_follows_a_link_cut(lab):
    expect_up = ["roceP2p1s0f0 port 1 ==> enP2p1s0f0np0 (Down)",
                 "roceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)",
                 "rocep1s0f0 port 1 ==> enp1s0f0np0 (Down)",
                 "rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)"]
    assert lab.exec("spark1", ["ibdev2netdev"]).stdout.splitlines() == expect_up
    try:
        faults.cut_link("spark2", "enp1s0f1np1")
        time.sleep(0.2)
        out = lab.exec("spark1", ["ibdev2netdev"]).stdout.splitlines()
        assert out[3] == "rocep1s0f1 port 1 ==> enp1s0f1np1 (Down)"
        assert out[1] == "roceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)"
    finally:
        faults.restore_link("spark2", "enp1s0f1np1")
    for _ in range(50):
        if lab.exec("spark1", ["ibdev2netdev"]).stdout.splitlines() == expect_up:
            break
        time.sleep(0.1)
    assert lab.exec("spark1", ["ibdev2netdev"]).stdout.splitlines() == expect_up


def test_nvidia_smi_matches_captured_formats(lab):
    h = "spark1"
    before = gb10.read_gpu_conf(h)
    try:
        gb10.set_gpu_conf(h, TEMP_C="40", POWER_W="11.37", PSTATE="P0",
                          DRIVER_VERSION="580.95.05")
        table = lab.exec(h, ["nvidia-smi"]).stdout.splitlines()
        assert CAPTURED_HEADER in table
        assert CAPTURED_GPU_ROW in table
        assert CAPTURED_TEMP_ROW in table
        assert all(len(l) == 91 for l in table[1:] if l.startswith(("|", "+")))
        out = lab.exec(h, ["nvidia-smi", "-L"]).stdout
        assert re.fullmatch(r"GPU 0: NVIDIA GB10 \(UUID: GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}"
                            r"-[0-9a-f]{12}\)\n", out)
        gb10.set_driver_version(h, "580.126.09")
        q = lab.exec(h, ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                         "--format=csv,noheader"]).stdout
        assert q == "NVIDIA GB10, [N/A], 580.126.09\n"
        q = lab.exec(h, ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
        assert q.stdout == "12.1\n"
        gb10.set_gpu_conf(h, TEMP_C="39", POWER_W="3.74")
        q = lab.exec(h, ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,memory.free,"
                         "temperature.gpu,power.draw", "--format=csv,noheader"]).stdout
        assert q == "NVIDIA GB10, [N/A], [N/A], [N/A], 39, 3.74 W\n"
        q = lab.exec(h, ["nvidia-smi", "--query-gpu=power.draw,memory.free", "--format=csv,"
                         "nounits"]).stdout
        assert q == "power.draw, memory.free\n3.74, [N/A]\n"
        bad = lab.exec(h, ["nvidia-smi", "--query-gpu=bogus", "--format=csv"], check=False)
        assert bad.returncode != 0 and 'Field "bogus" is not a valid field' in bad.stdout
        topo = lab.exec(h, ["nvidia-smi", "topo", "-m"]).stdout
        assert ("NIC Legend:\n\n  NIC0: rocep1s0f0\n  NIC1: rocep1s0f1\n"
                "  NIC2: roceP2p1s0f0\n  NIC3: roceP2p1s0f1\n") in topo
    finally:
        gb10.set_gpu_conf(h, **before)


def test_driver_version_is_per_host(lab):
    before = gb10.read_gpu_conf("spark2")["DRIVER_VERSION"]
    q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        gb10.set_driver_version("spark2", "580.82.09")
        assert lab.exec("spark2", q).stdout.strip() == "580.82.09"
        assert lab.exec("spark1", q).stdout.strip() != "580.82.09"
        assert "Driver Version: 580.82.09" in lab.exec("spark2", ["nvidia-smi"]).stdout
    finally:
        gb10.set_driver_version("spark2", before)


def test_spark_release_and_toolkit(lab):
    rel = lab.ssh("spark2", "cat /etc/dgx-release; nvidia-ctk --version; "
                  "dpkg-query -W -f='${Version}' nvidia-container-toolkit").stdout
    assert 'DGX_NAME="DGX Spark"' in rel and 'DGX_PRETTY_NAME="NVIDIA DGX Spark"' in rel
    assert "NVIDIA Container Toolkit CLI version 1.19.0" in rel
    assert rel.rstrip().endswith("1.19.0-1")
    hook = lab.exec("spark2", ["nvidia-container-runtime-hook", "prestart"], input='{"x":1}')
    assert hook.returncode == 0


def test_no_control_machine_leak(lab):
    r = lab.ssh("spark1", "echo PATH=$PATH; command -v python3; command -v nvcc ptxas ray pyenv;"
                " python3 -c 'import huggingface_hub' 2>&1 | tail -1; ls /usr/local/bin; "
                "docker --version; ls -A /opt")
    out = r.stdout
    assert "PATH=/usr/local/bin:/usr/bin:/bin:/usr/games\n" in out
    assert "\n/usr/bin/python3\n" in out
    for leak in ("nvcc", "ptxas", "/ray", "pyenv", ".venv"):
        assert leak not in out.split("ModuleNotFoundError")[0].split("\n", 1)[1], leak
    assert "ModuleNotFoundError: No module named 'huggingface_hub'" in out
    assert "Docker version 20.10" in out
    local_bin = set(lab.exec("spark1", ["ls", "/usr/local/bin"]).stdout.split())
    assert set(gb10.BIN_STANDINS) <= local_bin <= set(gb10.BIN_STANDINS) | {"ollama"}
    # a login shell (bash -l) gets Debian's PATH too, and root's shell files are Debian's
    r = lab.ssh("spark1", "bash -lc 'echo $PATH'")
    assert r.stdout.strip() == "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
    assert ".pyenv" not in lab.exec("spark1", ["cat", "/root/.bashrc"]).stdout
    assert lab.exec("spark1", ["ls", "/home"]).stdout.split() == ["nvidia"]


def test_docker_root_works_nvidia_needs_group(lab):
    h = "spark2"
    info = lab.exec(h, ["docker", "info", "--format", "{{.ServerVersion}} {{.DockerRootDir}}"])
    assert info.stdout.startswith("20.10") and "/var/lib/docker" in info.stdout
    # docker's store is a disk of each host's own (sparklab/hosts.py docker_disk), not a folder of the
    # machine's file system
    disks = {n: lab.exec(n, ["findmnt", "-n", "-o", "FSTYPE,SOURCE", "/var/lib/docker"]).stdout.split()
             for n in ("spark1", "spark2")}
    assert all(fs == "ext4" and dev.startswith("/dev/loop") for fs, dev in disks.values()), disks
    assert disks["spark1"][1] != disks["spark2"][1]
    r = lab.ssh(h, "docker info")
    assert r.returncode != 0 and "permission denied" in (r.stdout + r.stderr)
    try:
        lab.exec(h, ["usermod", "-aG", "docker", "nvidia"])
        r = lab.ssh(h, "docker info --format '{{.ServerVersion}}'")
        assert r.returncode == 0 and r.stdout.startswith("20.10"), r.stderr
        # the group was added on spark2 only
        assert "docker" not in lab.ssh("spark1", "id -nG").stdout.split()
    finally:
        lab.exec(h, ["gpasswd", "-d", "nvidia", "docker"], check=False)
    # socket belongs to this host's docker group
    st = lab.exec(h, ["stat", "-c", "%G %a", "/var/run/docker.sock"]).stdout.split()
    assert st == ["docker", "660"]
    mirrors = lab.exec(h, ["docker", "info", "--format", "{{json .RegistryConfig.Mirrors}}"])
    assert "http://10.77.0.1:5000" in mirrors.stdout


TINY_IMAGE = r"""
set -e
r=$(mktemp -d)
for f in /usr/bin/dash /usr/bin/cat; do
  for x in $f $(ldd $f | grep -o '/[^ ]*'); do mkdir -p "$r$(dirname $x)"; cp -L "$x" "$r$x"; done
done
ln -s usr/bin "$r/bin"
tar -C "$r" -c . | docker import - sparklab/tiny:1 >/dev/null
rm -rf "$r"
"""


def test_docker_run_gpus_all(lab):
    h = "spark1"
    assert lab.exec(h, ["sh", "-s"], input=TINY_IMAGE).returncode == 0
    r = lab.exec(h, ["docker", "run", "--rm", "--gpus", "all", "--network", "host",
                     "sparklab/tiny:1", "/bin/dash", "-c", "echo gpu-ok; cat /etc/hostname"],
                 check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("gpu-ok")
    # the other host's daemon does not have the image: separate data roots
    r2 = lab.exec("spark2", ["docker", "image", "inspect", "sparklab/tiny:1"], check=False)
    assert r2.returncode != 0
    lab.exec(h, ["docker", "image", "rm", "sparklab/tiny:1"], check=False)


def test_faults_sshd_dockerd_and_shaping(lab):
    h = "spark2"
    try:
        faults.stop_sshd(h)
        r = lab.ssh(h, "true")
        assert r.returncode == 255 and "Connection refused" in r.stderr
    finally:
        faults.start_sshd(h)
    assert lab.ssh(h, "true").returncode == 0
    try:
        assert "killed" in faults.kill_dockerd(h)
        assert lab.exec(h, ["docker", "info"], check=False).returncode != 0
    finally:
        faults.start_dockerd(h)
    assert lab.exec(h, ["docker", "info"], check=False).returncode == 0
    try:
        faults.slow_link(h, "enp1s0f1np1", rate="10mbit")
        q = lab.exec(h, ["tc", "qdisc", "show", "dev", "enp1s0f1np1"]).stdout
        assert "tbf" in q and "10Mbit" in q
    finally:
        faults.unslow_link(h, "enp1s0f1np1")
    assert "tbf" not in lab.exec(h, ["tc", "qdisc", "show", "dev", "enp1s0f1np1"]).stdout


def test_up_is_idempotent_and_inventory(lab):
    from sparklab import up
    t0 = time.monotonic()
    res = up.up(2, images=False, hub=False, quiet=True)   # the session's own call (tests/lab/conftest.py)
    assert res.changed == []
    assert time.monotonic() - t0 < 15
    inv = yaml.safe_load(lab.inventory.read_text())
    assert inv["hosts"] == {"spark1": {"address": "10.77.0.11"}, "spark2": {"address": "10.77.0.12"}}
    assert inv["defaults"]["become_password_file"] == "/run/sparkprov-lab/become_password"
    assert inv["groups"] == {"sparks": ["spark1", "spark2"]}


def test_ollama_standin_holds_and_frees_memory(lab):
    from sparklab import ollama
    h = "spark1"
    try:
        ollama.start_ollama(h, preload="llama3.1:8b", size_mb=200)
        models = ollama.loaded_models(h)
        assert [m["name"] for m in models] == ["llama3.1:8b"]
        assert models[0]["size"] == 200 * 2**20
        pid = ollama.ollama_pid(h)

        def rss() -> int:
            return int(open(f"/proc/{pid}/status").read().split("VmRSS:")[1].split()[0])

        assert rss() > 190 * 1024
        unload = ("import json,urllib.request as u;o=u.build_opener(u.ProxyHandler({}));"
                  "print(o.open(u.Request('http://127.0.0.1:11434/api/generate',data=json.dumps("
                  "{'model':'llama3.1:8b','keep_alive':0}).encode()),timeout=5).read().decode())")
        r = lab.exec(h, ["python3", "-c", unload])
        assert '"done_reason": "unload"' in r.stdout
        assert ollama.loaded_models(h) == []
        assert rss() < 100 * 1024
        # only on 127.0.0.1 of this host: spark2 has no server
        assert not ollama.ollama_running("spark2")
    finally:
        ollama.stop_ollama(h)


@pytest.mark.lab_teardown
def test_down_leaves_nothing_behind(lab):
    from conftest import snapshot
    from sparklab import hosts, net, up
    # simulate a crash first: spark1's anchor and sshd die without any clean-up
    rec = state.LabRecord.load()
    ns_before = {n: (os.stat(f"/proc/{h.anchor_pid}/ns/net").st_ino,
                     os.stat(f"/proc/{h.anchor_pid}/ns/mnt").st_ino)
                 for n, h in rec.hosts.items()}
    hosts.kill_pids([rec.hosts["spark1"].anchor_pid], grace=0)
    removed = up.down(quiet=True)
    assert removed
    after = snapshot()
    assert not state.STATE_DIR.exists()
    assert not [n for n in after["netns"] if n.startswith("spark")]
    assert not [l for l in after["links"] if l.startswith(("sl", "sparklab"))]
    assert not [m for m in after["mounts"] if "sparkprov-lab" in m]
    # the hosts' docker disks: the kernel detaches each loop device (mount -o loop: autoclear) once
    # the last process of its host's mount namespace is gone
    deadline = time.monotonic() + 10
    while str(state.STATE_DIR) in (loops := subprocess.run(
            ["losetup", "--list", "--noheadings", "--output", "BACK-FILE"],
            capture_output=True, text=True).stdout) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert str(state.STATE_DIR) not in loops
    assert not after["cgroups"]
    lab_cmd = re.compile(r"sparkprov-lab|sshd_config|--cgroup-parent /sparklab")
    assert not [c for _p, (_o, c) in after["procs"].items() if lab_cmd.search(c)]
    # no process is left in any namespace the lab made (network or mount)
    lab_ns = {("net", hosts_ns[0]) for hosts_ns in ns_before.values()} | {
        ("mnt", hosts_ns[1]) for hosts_ns in ns_before.values()}
    left = []
    for pid in after["procs"]:
        for kind in ("net", "mnt"):
            try:
                if (kind, os.stat(f"/proc/{pid}/ns/{kind}").st_ino) in lab_ns:
                    left.append(pid)
            except OSError:
                pass
    assert left == []
    if lab.baseline is not None:
        # compared with the machine before this session's lab.up (other users of the machine
        # may add their own things meanwhile: only lab-made kinds of names are compared)
        b = lab.baseline
        labish = re.compile(r"^(spark\d+|sparklab.*|sl\d.*|sltmp.*)$")
        assert {n for n in after["netns"] if labish.match(n)} == {
            n for n in b["netns"] if labish.match(n)}
        assert {n for n in after["links"] if labish.match(n)} == {
            n for n in b["links"] if labish.match(n)}
        assert {m for m in after["mounts"] - b["mounts"] if "spark" in m} == set()
    # twice in a row: nothing to do
    assert up.down(quiet=True) == []
    # after a partial up (namespace and management link only), down still cleans up
    rec = state.LabRecord()
    rec.hosts["spark1"] = state.HostRecord("spark1", 1, state.host_address(1))
    rec.save()
    net.ensure_netns("spark1")
    net.ensure_mgmt("spark1", 1, state.host_address(1))
    assert up.down(quiet=True)
    assert "spark1" not in net.netns_list() and "sparklab0" not in net.links()
    assert not state.STATE_DIR.exists()
