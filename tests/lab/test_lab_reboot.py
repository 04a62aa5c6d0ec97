"""`lab.fault reboot HOST`: a power cycle brings a host back only from what is persisted."""
# Engine: none: no model is served in this module.
from __future__ import annotations

import time

import pytest

from sparklab import faults
from sparklab.state import FABRIC_IFACES
from tests.lab.conftest import require

pytestmark = pytest.mark.lab

HOST, PEER = "spark2", "spark1"
RAIL = "enp1s0f1np1"
DOCKER = "docker -H unix:///run/docker.sock"
NETPLAN = "/etc/netplan/40-sparkprov-fabric.yaml"
# what provision's fabric module writes (one subnet per rail, MTU 9000), mode 0600
GOOD = """network:
  version: 2
  ethernets:
    enp1s0f1np1:
      dhcp4: false
      dhcp6: false
      mtu: 9000
      addresses: [192.168.177.12/24]
"""


def _link(lab, host, ifc=RAIL):
    out = lab.sh(host, f"ip -o link show {ifc}; ip -o -4 addr show dev {ifc}").stdout
    mtu = int(out.split(" mtu ", 1)[1].split()[0])
    addrs = [w for line in out.splitlines() if " inet " in line
             for w in [line.split(" inet ", 1)[1].split()[0]]]
    return {"mtu": mtu, "addrs": addrs, "up": ",UP" in out.split(">", 1)[0] or "<UP" in out}


@pytest.fixture
def netplan_dir(lab):
    """Keep the host's own /etc/netplan as it was (other lab tests write there)."""
    saved = lab.sh(HOST, "mkdir -p /root/netplan-saved && cp -a /etc/netplan/. /root/netplan-saved/ "
                         "2>/dev/null; rm -f /etc/netplan/*.yaml; true")
    assert saved.returncode == 0
    yield
    lab.sh(HOST, "rm -f /etc/netplan/*.yaml; cp -a /root/netplan-saved/. /etc/netplan/ 2>/dev/null; "
                 "rm -rf /root/netplan-saved")
    lab.sh(PEER, f"ip addr flush dev {RAIL}; ip link set {RAIL} mtu 1500")
    lab.sh(HOST, f"ip addr flush dev {RAIL}; ip link set {RAIL} mtu 1500")


@pytest.fixture(scope="module")
def smoke_image(lab):
    from sparklab import image
    from sparklab.state import LabRecord
    url = LabRecord.load().registry_url
    require([] if url else ["the lab registry (lab.up did not start it: docker-registry, make deps)"])
    image.ensure_images(url, [image.SMOKE_IMAGE])
    for h in (HOST,):
        r = lab.sh(h, f"{DOCKER} pull -q {image.SMOKE_IMAGE}", timeout=120)
        assert r.returncode == 0, r.stderr
    return image.SMOKE_IMAGE


def _status(lab, name):
    r = lab.sh(HOST, f"{DOCKER} inspect -f '{{{{.State.Status}}}} {{{{.State.ExitCode}}}} "
                     f"{{{{.RestartCount}}}}' {name}")
    return r.stdout.split()


def _wait(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.3)
    return pred()


def test_reboot_resets_network_and_keeps_only_restart_policy_containers(lab, netplan_dir, smoke_image):
    names = ("rb-unless-stopped", "rb-always", "rb-none")
    lab.sh(HOST, f"{DOCKER} rm -f {' '.join(names)}")
    try:
        for name, policy in zip(names, ("unless-stopped", "always", "no")):
            r = lab.sh(HOST, f"{DOCKER} run -d --name {name} --restart {policy} --network host "
                             f"{smoke_image} sleep 100000")
            assert r.returncode == 0, r.stderr
        # live settings nothing persisted: an address, jumbo MTU, shaping
        assert lab.sh(HOST, f"ip addr add 192.168.177.12/24 dev {RAIL} && ip link set {RAIL} mtu 9000 "
                            "&& echo scratch > /tmp/scratch && echo kept > /var/lib/kept").returncode == 0
        assert _link(lab, HOST) == {"mtu": 9000, "addrs": ["192.168.177.12/24"], "up": True}
        sshd_before = lab.sh(HOST, "cat /run/sshd.pid").stdout.strip()
        t0 = time.monotonic()
        out = faults.apply("reboot", HOST)
        took = time.monotonic() - t0
        assert "rebooted" in out and "nothing applied" in out, out
        print(f"reboot of {HOST}: {took:.1f}s\n{out}")
        # live network settings are gone; nothing brought them back
        for ifc in FABRIC_IFACES:
            st = _link(lab, HOST, ifc)
            assert st["mtu"] == 1500 and st["addrs"] == [], (ifc, st)
        # volatile /tmp emptied, disk kept
        assert lab.sh(HOST, "test -e /tmp/scratch").returncode != 0
        assert lab.sh(HOST, "cat /var/lib/kept").stdout.strip() == "kept"
        # sshd and dockerd are back (new processes)
        r = lab.ssh(HOST, "hostname")
        assert r.returncode == 0 and r.stdout.strip() == HOST, r.stderr
        assert lab.sh(HOST, "cat /run/sshd.pid").stdout.strip() != sshd_before
        assert lab.sh(HOST, f"{DOCKER} version --format '{{{{.Server.Version}}}}'").returncode == 0
        # docker's own restore: restart policies decide
        assert _wait(lambda: _status(lab, "rb-unless-stopped")[:1] == ["running"]), _status(lab, "rb-unless-stopped")
        assert _wait(lambda: _status(lab, "rb-always")[:1] == ["running"]), _status(lab, "rb-always")
        st = _status(lab, "rb-none")
        assert st[0] == "exited" and st[1] != "0", st
        # the restarted containers are new processes in the new boot, not survivors
        pid = lab.sh(HOST, f"{DOCKER} inspect -f '{{{{.State.Pid}}}}' rb-unless-stopped").stdout.strip()
        assert pid.isdigit() and int(pid) > 0
    finally:
        lab.sh(HOST, f"{DOCKER} rm -f {' '.join(names)}; rm -f /var/lib/kept")


def test_reboot_restores_fabric_from_netplan(lab, netplan_dir):
    assert lab.sh(HOST, f"mkdir -p /etc/netplan && umask 077 && cat > {NETPLAN}", input=GOOD).returncode == 0
    # the peer keeps its live settings (it did not reboot)
    assert lab.sh(PEER, f"ip addr replace 192.168.177.11/24 dev {RAIL} && ip link set {RAIL} mtu 9000"
                  ).returncode == 0
    out = faults.apply("reboot", HOST)
    assert f"{RAIL}: up, mtu 9000, address 192.168.177.12/24" in out, out
    st = _link(lab, HOST)
    assert st == {"mtu": 9000, "addrs": ["192.168.177.12/24"], "up": True}, st
    # rendered by the real netplan into the host's /run (systemd-networkd's directory)
    rendered = lab.sh(HOST, "cat /run/systemd/network/10-netplan-enp1s0f1np1.network").stdout
    assert "Address=192.168.177.12/24" in rendered and "MTUBytes=9000" in rendered, rendered
    # and the fabric works again: unfragmented jumbo frames both ways
    r = _wait(lambda: lab.sh(PEER, "ping -c 1 -W 1 -M do -s 8972 192.168.177.12").returncode == 0, 10)
    assert r, lab.sh(PEER, "ping -c 1 -W 1 -M do -s 8972 192.168.177.12").stdout
    # the unconfigured twins stay unconfigured
    assert _link(lab, HOST, "enP2p1s0f1np1")["addrs"] == []


@pytest.mark.parametrize("bad,why", [
    (GOOD.replace("enp1s0f1np1", "enp1s0f1np0"), "names an interface the host does not have"),
    (GOOD.replace("addresses: [192.168.177.12/24]", "addresses: [192.168.177.12/24"), "is not valid YAML"),
])
def test_reboot_with_a_wrong_netplan_file_leaves_the_fabric_down(lab, netplan_dir, bad, why):
    assert lab.sh(HOST, f"mkdir -p /etc/netplan && umask 077 && cat > {NETPLAN}", input=bad).returncode == 0
    assert lab.sh(PEER, f"ip addr replace 192.168.177.11/24 dev {RAIL} && ip link set {RAIL} mtu 9000"
                  ).returncode == 0
    out = faults.apply("reboot", HOST)
    st = _link(lab, HOST)
    assert st["addrs"] == [] and st["mtu"] == 1500, (why, st, out)
    assert lab.sh(PEER, "ping -c 1 -W 1 192.168.177.12").returncode != 0, why
    log = lab.sh(HOST, "cat /var/log/sparklab-boot.log").stdout
    assert ("netplan generate failed" in log) if "YAML" in why else ("no interface matches" in log), log
    # the host itself is up (ssh answers): only its fabric did not come back
    assert lab.ssh(HOST, "hostname").returncode == 0
