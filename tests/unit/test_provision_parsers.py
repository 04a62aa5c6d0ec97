"""Hardware fact parsers on real captures: GB10 (tests/fixtures/gb10/, from published Spark
output) and a datacenter GPU (tests/fixtures/h200/, captured on an H200)."""

from pathlib import Path

import pytest

from sparkprov.facts import fabric as fabric_facts
from sparkprov.facts import files as file_facts
from sparkprov.facts import hardware as hw
from sparkprov.facts import runtimes as rt

GB10 = Path(__file__).resolve().parents[1] / "fixtures" / "gb10"
H200 = Path(__file__).resolve().parents[1] / "fixtures" / "h200"


def read(d: Path, name: str) -> str:
    return (d / name).read_text()


def test_G16_gb10_table_header_driver_and_cuda_memory_not_supported():
    header = hw.parse_smi_header(read(GB10, "nvidia-smi.txt"))
    assert header == {"driver_version": "580.95.05", "cuda_version": "13.0"}
    assert "Not Supported" in read(GB10, "nvidia-smi.txt")  # memory column: unified memory


def test_G16_gb10_query_memory_is_na_parsed_as_none():
    line = read(GB10, "query-name-memory-driver.csv").strip()  # NVIDIA GB10, [N/A], 580.126.09
    name, mem, drv = line.split(", ")
    assert hw._mib(mem) is None and name == "NVIDIA GB10" and hw.version_tuple(drv) == (580, 126, 9)
    five = read(GB10, "query-five-fields.csv").strip().split(", ")
    assert [hw._mib(v) for v in five[1:4]] == [None, None, None]


def test_G16_full_query_line_gb10_compute_cap_12_1():
    # the 8-field query sparkprov sends, with GB10's values as captured ([N/A] memory, cap 12.1)
    gpus = hw.parse_gpu_query("0, NVIDIA GB10, GPU-b0ec33a0-2589-53de-953c-0713d37d0794, 12.1, 580.95.05, [N/A], [N/A], 0000000F:01:00.0\n")
    assert gpus[0]["compute_cap"] == "12.1" and gpus[0]["memory_total_mib"] is None


def test_gb10_list_and_topo_nic_legend():
    assert hw.parse_smi_list(read(GB10, "nvidia-smi-L.txt")) == [
        {"index": 0, "name": "NVIDIA GB10", "uuid": "GPU-b0ec33a0-2589-53de-953c-0713d37d0794"}]
    assert hw.parse_topo_nics(read(GB10, "topo-nic-legend.txt")) == {
        "NIC0": "rocep1s0f0", "NIC1": "rocep1s0f1", "NIC2": "roceP2p1s0f0", "NIC3": "roceP2p1s0f1"}


def test_datacenter_gpu_real_memory_and_compute_cap_9_0():
    # captured with ...,memory.used,memory.free: the same 8 columns, memory.free where sparkprov asks pci.bus_id
    g = hw.parse_gpu_query(read(H200, "query.csv"))[0]
    assert (g["index"], g["name"], g["uuid"], g["compute_cap"], g["driver_version"]) == (
        0, "NVIDIA H200", "GPU-4a19e017-ace8-5806-ebfd-e0064be08775", "9.0", "580.159.04")
    assert (g["memory_total_mib"], g["memory_used_mib"]) == (143771, 0)


def test_datacenter_gpu_h100_name_with_spaces_and_header():
    gpus = hw.parse_gpu_query("0, NVIDIA H100 80GB HBM3, GPU-0123, 9.0, 570.86.15, 81559 MiB, 0 MiB, 00000000:18:00.0\n")
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3" and gpus[0]["compute_cap"] == "9.0"
    assert gpus[0]["memory_total_mib"] == 81559
    assert hw.parse_smi_header(read(H200, "nvidia-smi.txt")) == {"driver_version": "580.159.04", "cuda_version": "13.0"}
    assert hw.parse_smi_list(read(H200, "nvidia-smi-L.txt"))[0]["name"] == "NVIDIA H200"


def test_nvidia_smi_fact_output_shapes():
    q = "0, NVIDIA GB10, GPU-b0, 12.1, 580.95.05, [N/A], [N/A], 0000000F:01:00.0\n"
    out = f"@query\n{q}@rc=0\n@table\n{read(GB10, 'nvidia-smi.txt')}"
    parsed = hw.parse_nvidia_smi(out)
    assert parsed["driver_version"] == "580.95.05" and parsed["cuda_version"] == "13.0" and not parsed["error"]
    assert hw.parse_nvidia_smi("@absent\n")["present"] is False
    broken = hw.parse_nvidia_smi("@query\nNVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
                                 "@rc=9\n@table\nNVIDIA-SMI has failed\n")
    assert broken["error"].startswith("NVIDIA-SMI has failed")


def test_G13_G16_meminfo_real_capture_in_bytes():
    mem = hw.parse_meminfo(read(H200, "meminfo.txt"))
    assert mem["MemTotal"] == 131981020 * 1024 and mem["MemAvailable"] == 131473880 * 1024


def test_G18_modeset_zero_on_kernel_cmdline():
    assert hw.parse_cmdline("BOOT_IMAGE=/vmlinuz ro nvidia-drm.modeset=0 quiet")["modeset"] == "0"
    assert hw.parse_cmdline(read(H200, "cmdline.txt"))["modeset"] is None


def test_G33_ibdev2netdev_real_capture_twins():
    devs = fabric_facts.parse_ibdev2netdev(read(GB10, "ibdev2netdev.txt"))
    assert [(d["hca"], d["iface"], d["up"]) for d in devs] == [
        ("roceP2p1s0f0", "enP2p1s0f0np0", False), ("roceP2p1s0f1", "enP2p1s0f1np1", True),
        ("rocep1s0f0", "enp1s0f0np0", False), ("rocep1s0f1", "enp1s0f1np1", True)]
    assert sorted(["enP2p1s0f1np1", "enp1s0f1np1"], key=fabric_facts.iface_order) == ["enp1s0f1np1", "enP2p1s0f1np1"]
    with pytest.raises(ValueError):
        fabric_facts.parse_ibdev2netdev("garbage line")


def _ip_json(name, mtu, flags, state, addrs):
    import json
    return json.dumps([{"ifname": name, "mtu": mtu, "flags": flags, "operstate": state, "address": "4c:bb:47:2f:91:13",
                        "addr_info": [{"family": "inet", "local": a, "prefixlen": p, "scope": s} for a, p, s in addrs]}])


def test_G32_fabric_info_contract_from_capture():
    devs = fabric_facts.parse_ibdev2netdev(read(GB10, "ibdev2netdev.txt"))
    # the static-address capture (ip addr show): enp1s0f1np1 192.168.100.10/24, mtu 1500, UP
    links = fabric_facts.parse_ip_addr(_ip_json("enp1s0f1np1", 1500, ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"], "UP",
                                      [("192.168.100.10", 24, "global")]))
    info = fabric_facts.fabric_info(devs, links)
    assert info["rails"] == [{"iface": "enp1s0f1np1", "address": "192.168.100.10", "prefix": 24, "hca": "rocep1s0f1",
                              "mtu": 1500, "up": True}]
    assert info["node_ip"] == "192.168.100.10" and info["nccl_socket_ifname"] == "enp1s0f1np1"
    assert info["gloo_socket_ifname"] == "enp1s0f1np1" and info["ucx_net_devices"] == "enp1s0f1np1"
    assert info["nccl_ib_hca"] == "rocep1s0f1"
    # link-local only (the ip -br capture: 169.254.127.30/16) is not a rail
    ll = fabric_facts.parse_ip_addr(_ip_json("enp1s0f1np1", 1500, ["UP", "LOWER_UP"], "UP", [("169.254.127.30", 16, "link")]))
    assert fabric_facts.fabric_info(devs, ll)["rails"] == []


def test_net_state_and_routes():
    out = ("ssh=10.77.0.1 5555 10.77.0.11 22\nnetplan=\n@addr\n"
           + _ip_json("enP7s7", 1500, ["UP", "LOWER_UP"], "UP", [("10.77.0.11", 24, "global")])
           + '\n@route\n[{"dst":"default","gateway":"10.77.0.1","dev":"enP7s7"},{"dst":"10.77.0.0/24","dev":"enP7s7"}]\n')
    st = fabric_facts.parse_net_state(out)
    assert st["ssh_server_addr"] == "10.77.0.11" and st["netplan"] is None
    assert st["routes"][0] == {"dst": "default", "dev": "enP7s7", "gateway": "10.77.0.1"}


def test_G32_ping_and_ssh_probe_parsing():
    out = ("@ping 192.168.100.11 192.168.100.12\n2 packets transmitted, 2 received, 0% packet loss, time 201ms\n"
           "rtt min/avg/max/mdev = 0.05/0.06/0.07/0.01 ms\n@rc=0\n"
           "@ping 192.168.101.11 192.168.101.12\nping: local error: message too long, mtu=1500\n"
           "2 packets transmitted, 0 received, +2 errors, 100% packet loss, time 1ms\n@rc=1\n"
           "@ssh 192.168.100.12\n@rc=0\n@ssh 192.168.101.12\nHost key verification failed.\n@rc=255\n")
    res = fabric_facts.MeshProbe((), 8972, "nvidia", ()).parse(out, "", 0)
    assert res["ping"]["192.168.100.11 192.168.100.12"]["ok"] is True
    bad = res["ping"]["192.168.101.11 192.168.101.12"]
    assert bad["ok"] is False and "message too long" in bad["error"]
    assert res["ssh"]["192.168.100.12"]["ok"] and res["ssh"]["192.168.101.12"]["error"] == "Host key verification failed."
    # one jumbo reply of two proves the path (a lost reply is loss, not a wrong MTU)
    lossy = fabric_facts.parse_ping("2 packets transmitted, 1 received, 50% packet loss, time 201ms\n")
    assert lossy["ok"] and lossy["received"] == 1 and lossy["error"] is None


def test_docker_state_capture_and_permission_denied():
    info_line = "29.2.1|runc|io.containerd.runc.v2 runc "  # values of the docker info capture
    assert "Server Version: 29.2.1" in read(GB10, "docker-info.txt")
    ok = rt.parse_docker_state(f"cli=/usr/bin/docker\nsession_groups=nvidia adm docker\nsocket=/var/run/docker.sock|root|docker|660\n"
                               f"info_rc=0\ninfo={info_line}\nctk=NVIDIA Container Toolkit CLI version 1.19.0\nhook=\n"
                               "toolkit_pkg=install ok installed|1.19.0-1\nsystemctl=/usr/bin/systemctl\n")
    assert ok["access"] and ok["server_version"] == "29.2.1" and ok["runtimes"] == ["io.containerd.runc.v2", "runc"]
    assert ok["toolkit"] == {"ctk": "1.19.0", "hook": None, "package": "1.19.0-1"}
    denied = rt.parse_docker_state("cli=/usr/bin/docker\nsession_groups=nvidia adm\nsocket=/var/run/docker.sock|root|docker|660\n"
                                   "info_rc=1\ninfo=permission denied while trying to connect to the Docker daemon socket\n"
                                   "ctk=\nhook=\ntoolkit_pkg=\nsystemctl=\n")
    assert not denied["access"] and "permission denied" in denied["error"]


def test_G14_ollama_ps():
    st = rt.parse_ollama_ps('{"models":[{"name":"qwen3:8b","model":"qwen3:8b","size":5200000000,"size_vram":5200000000,'
                            '"expires_at":"2026-01-01T02:00:00Z"}]}\n@rc=0\n')
    assert st["running"] and st["models"][0]["name"] == "qwen3:8b"
    assert rt.parse_ollama_ps("\n@rc=7\n") == {"running": False, "models": []}


def test_G36_nvcc_and_ptxas_real_versions():
    assert hw.parse_nvcc_version(read(H200, "nvcc.txt")) == "13.0.88"
    assert hw.parse_nvcc_version(read(H200, "ptxas.txt")) == "13.0.88"
    tk = hw.parse_cuda_toolkit("nvcc=\nptxas=\ntriton_ptxas=\ntoolkit=/usr/local/cuda-13.0/bin|V13.0.88|V13.0.88\n")
    assert tk["nvcc"] is None and tk["toolkits"] == [{"bin": "/usr/local/cuda-13.0/bin", "nvcc": "13.0.88", "ptxas": "13.0.88"}]


def test_G23_store_state_foreign_owned():
    st = file_facts.parse_owned_tree("stat=nvidia|nvidia|755\nsub=hub\nforeign=3\nforeign_path=root /home/nvidia/vllm/hub/models--x\n"
                              "entries=1\nsize=4096\nfree=84389134336\nfs_total=100000000000\nmount=/home\n")
    assert st["foreign_count"] == 3 and st["subdirs"] == ["hub"] and st["free"] == 84389134336 and st["mount"] == "/home"


def test_driver_version_compare():
    assert hw.driver_at_least("580.95.05", "580") and hw.driver_at_least("590.44.01", "590.44")
    assert not hw.driver_at_least("580.126.09", "590.44") and not hw.driver_at_least("580.82.09", "580.95.05")


def test_gpu_sensors_from_gb10_output():
    """gb10-outputs.md: `NVIDIA GB10, [N/A], [N/A], [N/A], 39, 3.74 W` (temperature.gpu, power.draw last)."""
    assert hw.parse_gpu_sensors("39, 3.74 W\n") == {"temperature_c": 39.0, "power_w": 3.74}
    assert hw.parse_gpu_sensors("[N/A], [N/A]\n") == {"temperature_c": None, "power_w": None}
    assert hw.parse_gpu_sensors("@absent\n") == {"temperature_c": None, "power_w": None}


def test_mesh_probe_runs_its_pings_at_once(tmp_path):
    """The probes of MeshProbe run side by side (a `a; b &` slip once ran them one after another:
    30 pings took 6 s). A stand-in `ping` on PATH waits until all four have started; run one at a
    time, the first would give up waiting and say so."""
    from sparkprov.facts.base import ShellCtx
    from sparkprov.transport.local import LocalTransport

    (tmp_path / "ping").write_text(
        "#!/bin/sh\n"
        f"echo start >> {tmp_path}/log\n"
        f"n=0; while [ \"$(grep -c start {tmp_path}/log)\" -lt 4 ]; do\n"
        "  n=$((n+1)); [ $n -gt 100 ] && { echo 'ping: alone'; exit 1; }; sleep 0.1\n"
        "done\n"
        "echo '2 packets transmitted, 2 received, 0% packet loss'\n")
    (tmp_path / "ping").chmod(0o755)
    pings = tuple((f"10.0.{i}.1", f"10.0.{i}.2") for i in range(4))
    probe = fabric_facts.MeshProbe(pings, 8972, "nvidia", ())
    script = f"PATH={tmp_path}:$PATH\n" + probe.command(ShellCtx(str(tmp_path)))
    res = probe.parse(LocalTransport("local").run_script(script).stdout, "", 0)
    assert len(res["ping"]) == 4
    assert all(r["ok"] for r in res["ping"].values()), res["ping"]


def test_mesh_probe_keeps_pings_error_line_and_retries_a_lost_reply(tmp_path):
    """The probe's summary of a ping keeps the error line (a wrong MTU names itself) and tries a
    path three times before calling it broken. A stand-in `ping` on PATH prints iputils' format:
    too long for one address, one lost reply then an answer for the other."""
    from sparkprov.facts.base import ShellCtx
    from sparkprov.transport.local import LocalTransport

    (tmp_path / "ping").write_text(
        "#!/bin/sh\n"
        'for a; do last=$a; done\n'
        'if [ "$last" = 10.0.0.2 ]; then\n'
        "  printf 'PING 10.0.0.2 (10.0.0.2) from 10.0.0.1 : 8972(9000) bytes of data.\\n"
        "ping: local error: message too long, mtu=1500\\n\\n--- 10.0.0.2 ping statistics ---\\n"
        "1 packets transmitted, 0 received, +1 errors, 100%% packet loss, time 0ms\\n\\n'; exit 1; fi\n"
        f'echo x >> {tmp_path}/tries; if [ "$(wc -l < {tmp_path}/tries)" -lt 2 ]; then\n'
        "  printf '\\n--- 10.0.1.2 ping statistics ---\\n1 packets transmitted, 0 received, 100%% packet loss\\n'; exit 1; fi\n"
        "printf 'PING 10.0.1.2 (10.0.1.2) 8972(9000) bytes of data.\\n8980 bytes from 10.0.1.2: icmp_seq=1 ttl=64 time=0.05 ms\\n\\n"
        "--- 10.0.1.2 ping statistics ---\\n1 packets transmitted, 1 received, 0%% packet loss, time 0ms\\n"
        "rtt min/avg/max/mdev = 0.050/0.050/0.050/0.000 ms\\n'\n")
    (tmp_path / "ping").chmod(0o755)
    probe = fabric_facts.MeshProbe((("10.0.0.1", "10.0.0.2"), ("10.0.1.1", "10.0.1.2")), 8972, "nvidia", ())
    out = LocalTransport("local").run_script(f"PATH={tmp_path}:$PATH\n" + probe.command(ShellCtx(str(tmp_path)))).stdout
    res = probe.parse(out, "", 0)["ping"]
    assert res["10.0.0.1 10.0.0.2"]["ok"] is False, out
    assert res["10.0.0.1 10.0.0.2"]["error"] == "ping: local error: message too long, mtu=1500"
    assert res["10.0.1.1 10.0.1.2"]["ok"] is True and res["10.0.1.1 10.0.1.2"]["received"] == 1, out
