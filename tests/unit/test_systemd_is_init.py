"""SYSTEMD_IS_INIT (sparkprov/facts/base.py), the shell test the guard and the firewall use to choose
a systemd unit or a boot-started process: run by a real shell against a root that Debian's real
`netplan generate` wrote into, as it writes into a lab host's /run at boot. The directory
/run/systemd/system that netplan leaves is not systemd; systemd's private socket is."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from sparkprov.facts.base import SYSTEMD_IS_INIT

FABRIC = """network:
  version: 2
  renderer: networkd
  ethernets:
    enp1s0f1np1:
      addresses: [192.168.100.11/24]
      mtu: 9000
"""


def is_init(root) -> bool:
    test = SYSTEMD_IS_INIT.replace("/run/", f"{root}/run/")
    return subprocess.run(["sh", "-c", test]).returncode == 0


def test_netplans_run_dir_is_not_systemd_its_private_socket_is(tmp_path):
    netplan = shutil.which("netplan")
    if not netplan:
        pytest.skip("netplan.io is not installed (make deps installs it)")
    (tmp_path / "etc/netplan").mkdir(parents=True)
    (tmp_path / "etc/netplan/40-sparkprov-fabric.yaml").write_text(FABRIC)
    (tmp_path / "etc/netplan/40-sparkprov-fabric.yaml").chmod(0o600)
    subprocess.run([netplan, "generate", "--root-dir", str(tmp_path)], check=True, capture_output=True)
    assert (tmp_path / "run/systemd/system").is_dir()      # what fooled the old test
    assert not is_init(tmp_path)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "run/systemd/private"))   # systemd as PID 1 has it
        assert is_init(tmp_path)
    finally:
        sock.close()
