"""Provision modules planned from recorded facts (pure): each gotcha the plans own is named."""

from __future__ import annotations

import pytest

from sparkprov.facts.base import ShellCtx
from sparkprov.modules.base import FactView, HostContext
from sparkprov.facts import fabric as fabric_facts
from sparkprov.facts import files as file_facts
from sparkprov.facts import hardware as hw
from sparkprov.facts import runtimes as rt
from sparkprov.facts import ssh as ssh_facts
from sparkprov.facts.accounts import GroupInfo, UserInfo
from sparkprov.facts.files import PathState
from sparkprov.modules import (docker_access, fabric, fabric_mesh, gpu_check, gpu_consistency, host_identity,
                               memory_hygiene, model_store, native_runtime, ssh_mesh)

SPARK_INFO = {"user": "nvidia", "home": "/home/nvidia", "arch": "aarch64", "kernel": "6.17.0-1014-nvidia",
              "hostname": "spark1", "os_pretty_name": "Ubuntu 24.04.3 LTS", "dgx_name": "DGX Spark",
              "dgx_ota_version": "7.2.3"}
GIB = 2**30


def ctx(name="spark1", info=None, vars=None, exports=None, play_hosts=("spark1", "spark2"), check=False):
    return HostContext(name, {"groups": {"sparks": ["spark1", "spark2"]}, **(vars or {})}, info or SPARK_INFO,
                       check=check, exports=exports if exports is not None else {h: {} for h in play_hosts},
                       play_hosts=list(play_hosts), become=True)


def view(pairs):
    return FactView({f.key: v for f, v in pairs}, {})


def plan(module, args, facts, host):
    m = module()
    a = m.Args.model_validate(args)
    return m.plan(a, m.view(a, view(facts), host), host)


# -- identity -----------------------------------------------------------------------------

def test_spark_identity_ok_and_non_spark_warns_not_fails():
    p = plan(host_identity.HostIdentityModule, {}, [], ctx())
    assert p.failed is None and not p.warnings and p.exports["identity"]["is_spark"]
    h100 = {**SPARK_INFO, "arch": "x86_64", "dgx_name": ""}
    p = plan(host_identity.HostIdentityModule, {}, [], ctx(info=h100))
    assert p.failed is None and "not a DGX Spark" in p.warnings[0] and "x86_64" in p.warnings[0]
    assert plan(host_identity.HostIdentityModule, {"require_spark": True}, [], ctx(info=h100)).failed


# -- gpu ----------------------------------------------------------------------------------

def smi(driver="580.95.05", name="NVIDIA GB10", cc="12.1", total=None):
    return {"present": True, "driver_version": driver, "cuda_version": "13.0", "error": None,
            "gpus": [{"index": 0, "name": name, "uuid": "GPU-x", "compute_cap": cc, "driver_version": driver,
                      "memory_total_mib": total, "memory_used_mib": None if total is None else 0, "bus_id": "x"}]}


MEM = {"MemTotal": 119 * GIB, "MemAvailable": 110 * GIB, "Cached": 5 * GIB}


def gpu_facts(s, cmdline="ro quiet"):
    return [(hw.NvidiaSmi(), s), (hw.MemInfo(), MEM), (hw.KernelCmdline(), hw.parse_cmdline(cmdline))]


@pytest.fixture
def no_catalog(monkeypatch):
    monkeypatch.setattr(gpu_check, "catalog_drivers", lambda: ())


def test_G16_G13_gb10_memory_from_meminfo(no_catalog):
    p = plan(gpu_check.GpuCheckModule, {}, gpu_facts(smi()), ctx(vars={"min_driver": "580"}))
    assert p.failed is None and "unified memory" in p.msg and "[N/A]" in p.msg
    g = p.exports["gpu"]
    assert g["unified_memory"] and g["memory_total_bytes"] == 119 * GIB and g["memory_available_bytes"] == 110 * GIB
    assert g["compute_cap"] == "12.1"


def test_datacenter_gpu_memory_from_nvidia_smi(no_catalog):
    info = {**SPARK_INFO, "arch": "x86_64", "dgx_name": ""}
    p = plan(gpu_check.GpuCheckModule, {}, gpu_facts(smi("570.86.15", "NVIDIA H100 80GB HBM3", "9.0", 81559)),
             ctx(info=info, vars={"min_driver": "570"}))
    assert p.failed is None and p.exports["gpu"]["memory_total_bytes"] == 81559 * 2**20
    assert not p.exports["gpu"]["unified_memory"] and "NVIDIA H100 80GB HBM3 (compute capability 9.0)" in p.msg


def test_too_old_driver_fails_naming_host_found_needed_fix(no_catalog):
    p = plan(gpu_check.GpuCheckModule, {"min_driver": "580.95.05"}, gpu_facts(smi("580.82.09")), ctx("spark2"))
    assert p.failed.startswith("spark2: NVIDIA driver 580.82.09 is too old: need >= 580.95.05")
    assert "Fix: upgrade the NVIDIA driver" in p.failed


def test_G5_catalog_minimum_and_warning_for_ngc_image(monkeypatch):
    monkeypatch.setattr(gpu_check, "catalog_drivers", lambda: (("nvcr.io/nvidia/vllm:25.12.post1-py3", "590.44"),
                                                              ("vllm/vllm-openai:cu130-nightly", None)))
    p = plan(gpu_check.GpuCheckModule, {}, gpu_facts(smi("580.126.09")), ctx(vars={"min_driver": "580"}))
    assert p.failed is None and ">= 580" in p.msg
    assert any("590.44" in w and "25.12.post1" in w and "G5" in w for w in p.warnings)
    need, source = gpu_check.min_driver_for(None, (("nvcr.io/nvidia/vllm:25.12.post1-py3", "590.44"),), None)
    assert need == "590.44" and "25.12.post1" in source


def test_no_nvidia_smi_fails_with_fix(no_catalog):
    absent = {"present": False, "gpus": [], "driver_version": None, "cuda_version": None, "error": None}
    p = plan(gpu_check.GpuCheckModule, {}, gpu_facts(absent), ctx(vars={"min_driver": "580"}))
    assert "nvidia-smi not found" in p.failed and "Fix:" in p.failed


def test_G18_modeset0_caps_utilization(no_catalog):
    p = plan(gpu_check.GpuCheckModule, {}, gpu_facts(smi(), "ro nvidia-drm.modeset=0"), ctx(vars={"min_driver": "580"}))
    assert p.exports["gpu"]["max_gpu_memory_utilization"] == 0.55 and any("G18" in w for w in p.warnings)


def test_driver_versions_differing_across_cluster_flagged():
    ex = {"spark1": {"gpu": {"driver_version": "580.95.05", "cuda_version": "13.0"}},
          "spark2": {"gpu": {"driver_version": "580.126.09", "cuda_version": "13.0"}}}
    p = plan(gpu_consistency.GpuConsistencyModule, {}, [], ctx(exports=ex))
    assert p.failed is None and "spark1 580.95.05, spark2 580.126.09" in p.warnings[0]
    assert plan(gpu_consistency.GpuConsistencyModule, {"strict": True}, [], ctx(exports=ex)).failed


# -- memory -------------------------------------------------------------------------------

def test_G14_ollama_models_warned_then_unloaded_when_asked():
    ol = {"running": True, "models": [{"name": "llama3.1:8b", "size": 5 * GIB}]}
    facts = [(hw.MemInfo(), MEM), (rt.OllamaState(), ol)]
    p = plan(memory_hygiene.MemoryHygieneModule, {}, facts, ctx())
    assert not p.changes and "G14" in p.warnings[0]
    p = plan(memory_hygiene.MemoryHygieneModule, {"unload_ollama": True}, facts, ctx())
    assert len(p.changes) == 1 and '"keep_alive": 0' in p.changes[0].script and "/api/generate" in p.changes[0].script


def test_G15_drop_caches_as_a_step():
    p = plan(memory_hygiene.MemoryHygieneModule, {"drop_caches": True},
             [(hw.MemInfo(), MEM), (rt.OllamaState(), {"running": False, "models": []})], ctx())
    assert "echo 3 > /proc/sys/vm/drop_caches" in p.changes[0].script and p.changes[0].verify is False


def test_G13_min_available_fails():
    low = {**MEM, "MemAvailable": 10 * GIB}
    p = plan(memory_hygiene.MemoryHygieneModule, {"min_available_gb": 60},
             [(hw.MemInfo(), low), (rt.OllamaState(), {"running": False, "models": []})], ctx())
    assert "only 10.0 GiB" in p.failed and "G13" in p.failed


# -- native runtime -----------------------------------------------------------------------

def test_G36_toolkit_off_path_gets_profile_and_missing_toolkit_fails_when_required():
    tk = {"nvcc": None, "nvcc_version": None, "ptxas": None, "ptxas_version": None, "triton_ptxas_path": None,
          "toolkits": [{"bin": "/usr/local/cuda-13.0/bin", "nvcc": "13.0.88", "ptxas": "13.0.88"}]}
    facts = [(hw.CudaToolkit(), tk), (PathState("/etc/profile.d/sparkprov-cuda.sh", with_content=True), {"exists": False})]
    p = plan(native_runtime.NativeRuntimeModule, {"required": True}, facts, ctx())
    assert "G36" in p.changes[0].summary and "TRITON_PTXAS_PATH=/usr/local/cuda-13.0/bin/ptxas" in p.changes[0].diff.after
    none = [(hw.CudaToolkit(), {**tk, "toolkits": []}), facts[1]]
    assert "G36" in plan(native_runtime.NativeRuntimeModule, {"required": True}, none, ctx()).failed
    assert plan(native_runtime.NativeRuntimeModule, {}, none, ctx()).skipped


# -- docker -------------------------------------------------------------------------------

def docker_facts(groups=("nvidia", "adm"), access=False, group_exists=True, image=None, passed=True):
    st = {"cli": "/usr/bin/docker", "session_groups": list(groups), "socket": {"path": "/var/run/docker.sock",
          "owner": "root", "group": "docker", "mode": 0o660}, "access": access, "server_version": "29.2.1",
          "default_runtime": "runc", "runtimes": ["runc"], "error": None if access else "permission denied",
          "toolkit": {"ctk": "1.19.0", "hook": None, "package": "1.19.0-1"}, "systemctl": "/usr/bin/systemctl"}
    out = [(rt.DockerState(), st), (rt.DockerDaemon(), {"running": True, "version": "29.2.1", "error": None}),
           (GroupInfo("docker"), {"name": "docker", "gid": 988, "members": []} if group_exists else None),
           (UserInfo("nvidia"), {"name": "nvidia", "uid": 1000, "gid": 1000, "home": "/home/nvidia", "shell": "/bin/bash",
                                 "groups": list(groups)})]
    if image:
        out += [(rt.DockerDaemon(image), {"running": True, "version": "29.2.1", "error": None, "image": "present"}),
                (rt.GpuSmokeRecord(image, (), True), {"state": "present", "key": "k" * 32, "passed": passed})]
    return out


def test_docker_group_created_and_membership_reconnects():
    p = plan(docker_access.DockerAccessModule, {}, docker_facts(group_exists=False), ctx())
    summaries = [c.summary for c in p.changes]
    assert summaries[0] == "create group docker" and "add nvidia to group docker" in summaries[1]
    assert p.changes[1].reconnect and "usermod -a -G docker nvidia" in p.changes[1].script


def test_docker_membership_proven_by_docker_info_in_session():
    p = plan(docker_access.DockerAccessModule, {}, docker_facts(("nvidia", "docker"), access=False), ctx())
    assert "docker info` fails in a new session" in p.failed
    ok = plan(docker_access.DockerAccessModule, {"smoke_image": "img:1"},
              docker_facts(("nvidia", "docker"), access=True, image="img:1"), ctx())
    assert ok.failed is None and "smoke image img:1 present" in ok.msg


def test_gpu_smoke_test_is_a_change_recorded_once_never_a_read():
    """A gather never runs a container: the smoke test runs as a change (as the login user) when no
    pass is recorded for this image, docker and driver, and writes the record."""
    from sparkprov.modules import gpu_smoke

    st = docker_facts(("nvidia", "docker"), access=True)[0]
    rec = (rt.GpuSmokeRecord("img:1", (), True), {"state": "present", "key": "k" * 32, "passed": False})
    p = plan(gpu_smoke.GpuSmoke, {"smoke_image": "img:1"}, [st, rec], ctx())
    (change,) = p.changes
    assert "GPU smoke test" in change.summary and "docker run --rm --gpus all img:1" in change.script
    assert "k" * 32 in change.script and change.predicts[0][1]["passed"] is True and change.become is False
    assert "docker run" not in rt.GpuSmokeRecord("img:1", (), True).command(ShellCtx("/home/nvidia"))
    ok = plan(gpu_smoke.GpuSmoke, {"smoke_image": "img:1"}, [st, (rec[0], {**rec[1], "passed": True})], ctx())
    assert ok.failed is None and not ok.changes and "--gpus all img:1` passed" in ok.msg
    assert plan(gpu_smoke.GpuSmoke, {}, [st], ctx()).skipped


# -- model store --------------------------------------------------------------------------

def store(**kw):
    return {"exists": True, "type": "directory", "owner": "nvidia", "group": "nvidia", "mode": 0o755, "subdirs": ["hub"],
            "foreign_count": 0, "foreign": [], "entries": 1, "size": 4096, "free": 500 * GIB, "mount": "/", **kw}


def test_G22_store_is_hf_home_and_compile_cache_mounted():
    facts = [(file_facts.OwnedTree("~/vllm", "nvidia", ("hub",)), {"exists": False, "foreign_count": 0, "foreign": [], "subdirs": [],
                                                            "free": 500 * GIB, "mount": "/"}),
             (file_facts.OwnedTree("~/vllm-compile-cache", "nvidia"), {"exists": False, "foreign_count": 0, "foreign": [], "subdirs": []})]
    p = plan(model_store.ModelStoreModule, {}, facts, ctx())
    assert "mkdir -p -- /home/nvidia/vllm /home/nvidia/vllm/hub" in p.changes[0].script
    mounts = p.exports["model_store"]["container"]
    assert mounts["env"] == {"HF_HOME": "/home/nvidia/vllm"}
    assert mounts["mounts"] == ["/home/nvidia/vllm:/home/nvidia/vllm", "/home/nvidia/vllm-compile-cache:/root/.cache/vllm"]


def test_G23_root_owned_leftovers_given_back():
    facts = [(file_facts.OwnedTree("~/vllm", "nvidia", ("hub",)), store(foreign_count=2, foreign=["root /home/nvidia/vllm/hub/x"])),
             (file_facts.OwnedTree("~/vllm-compile-cache", "nvidia"), store(subdirs=[]))]
    p = plan(model_store.ModelStoreModule, {}, facts, ctx())
    assert "G23" in p.changes[0].summary and p.changes[0].script == "chown -R -h nvidia: -- /home/nvidia/vllm"
    assert "G23" in plan(model_store.ModelStoreModule, {"fix_ownership": False}, facts, ctx()).failed


def test_G25_compile_cache_cleared_on_request():
    facts = [(file_facts.OwnedTree("~/vllm", "nvidia", ("hub",)), store()),
             (file_facts.OwnedTree("~/vllm-compile-cache", "nvidia"), store(subdirs=[], entries=7, size=3 * GIB))]
    assert not plan(model_store.ModelStoreModule, {}, facts, ctx()).changes
    p = plan(model_store.ModelStoreModule, {"clear_compile_cache": True}, facts, ctx())
    assert "G25" in p.changes[0].summary and "-mindepth 1 -delete" in p.changes[0].script


# -- fabric -------------------------------------------------------------------------------

IB = {"present": True, "devices": fabric_facts.parse_ibdev2netdev(
    "roceP2p1s0f0 port 1 ==> enP2p1s0f0np0 (Down)\nroceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)\n"
    "rocep1s0f0 port 1 ==> enp1s0f0np0 (Down)\nrocep1s0f1 port 1 ==> enp1s0f1np1 (Up)\n")}


def link(mtu=1500, addrs=(), up=True):
    return {"mtu": mtu, "up": up, "admin_up": True, "carrier": up, "mac": "x",
            "ipv4": [{"address": a, "prefix": p, "scope": "global"} for a, p in addrs]}


def net(links, routes=(), ssh="10.77.0.11"):
    base = {"enP7s7": link(1500, [("10.77.0.11", 24)]), "enp1s0f0np0": link(up=False), "enP2p1s0f0np0": link(up=False)}
    return {"ssh_server_addr": ssh, "netplan": "/usr/sbin/netplan", "links": {**base, **links},
            "routes": [{"dst": "default", "dev": "enP7s7", "gateway": "10.77.0.1"},
                       {"dst": "10.77.0.0/24", "dev": "enP7s7", "gateway": None}, *routes]}


NETPLAN = PathState(fabric.NETPLAN_FILE, with_content=True)


def fabric_plan(links, routes=(), netplan=None, name="spark1", vars=None):
    facts = [(fabric_facts.Ibdev2netdev(), IB), (fabric_facts.NetState(), net(links, routes)), (NETPLAN, netplan or {"exists": False})]
    return plan(fabric.FabricModule, {}, facts, ctx(name, vars=vars))


def test_G33_each_twin_own_subnet_mtu_9000_stable_addresses():
    p = fabric_plan({"enp1s0f1np1": link(), "enP2p1s0f1np1": link()}, name="spark2")
    rails = p.exports["fabric"]["rails"]
    assert [(r["iface"], r["address"], r["subnet"]) for r in rails] == [
        ("enp1s0f1np1", "192.168.100.12", "192.168.100.0/24"), ("enP2p1s0f1np1", "192.168.101.12", "192.168.101.0/24")]
    assert "mtu 1500 -> 9000" in p.changes[0].summary and "ip link set dev enp1s0f1np1 mtu 9000" in p.changes[0].script
    netplan = p.changes[-1]
    assert "mode 0600" in netplan.summary and "netplan generate" in netplan.script and "mtu: 9000" in netplan.diff.after
    # the same plan on every run
    assert fabric_plan({"enp1s0f1np1": link(), "enP2p1s0f1np1": link()}, name="spark2").exports == p.exports


def test_G32_nccl_settings_exported():
    p = fabric_plan({"enp1s0f1np1": link(), "enP2p1s0f1np1": link()})
    f = p.exports["fabric"]
    assert (f["node_ip"], f["nccl_socket_ifname"], f["gloo_socket_ifname"], f["ucx_net_devices"], f["nccl_ib_hca"]) == (
        "192.168.100.11", "enp1s0f1np1", "enp1s0f1np1", "enp1s0f1np1", "rocep1s0f1,roceP2p1s0f1")


def test_G33_pool_skips_subnets_routed_elsewhere_and_configured_clash_fails():
    routes = [{"dst": "192.168.100.0/24", "dev": "enP7s7", "gateway": None}]
    p = fabric_plan({"enp1s0f1np1": link(), "enP2p1s0f1np1": link()}, routes)
    assert [r["subnet"] for r in p.exports["fabric"]["rails"]] == ["192.168.101.0/24", "192.168.102.0/24"]
    bad = fabric_plan({"enp1s0f1np1": link(), "enP2p1s0f1np1": link()}, routes,
                      vars={"fabric_subnets": ["192.168.100.0/24", "192.168.101.0/24"]})
    assert "clashes with the existing route 192.168.100.0/24 via enP7s7" in bad.failed
    same = fabric_plan({"enp1s0f1np1": link(), "enP2p1s0f1np1": link()},
                       vars={"fabric_subnets": ["10.10.0.0/24", "10.10.0.0/25"]})
    assert "G33" in same.failed


def test_G33_converged_rails_are_ok_and_mtu_drift_is_a_change():
    good = {"enp1s0f1np1": link(9000, [("192.168.100.11", 24)]), "enP2p1s0f1np1": link(9000, [("192.168.101.11", 24)])}
    text = fabric.netplan_text(fabric_plan(good).exports["fabric"]["rails"], 9000).encode()
    np = {"exists": True, "type": "file", "mode": 0o600, "owner": "root", "group": "root", "content": text}
    assert not fabric_plan(good, netplan=np).changes
    drift = {**good, "enp1s0f1np1": link(1500, [("192.168.100.11", 24)])}
    p = fabric_plan(drift, netplan=np)
    assert [c.summary for c in p.changes] == ["enp1s0f1np1: mtu 1500 -> 9000"]


def test_management_link_is_never_a_rail():
    facts = [(fabric_facts.Ibdev2netdev(), IB), (fabric_facts.NetState(), net({"enp1s0f1np1": link(), "enP2p1s0f1np1": link()})),
             (NETPLAN, {"exists": False})]
    p = plan(fabric.FabricModule, {"rails": ["enP7s7"]}, facts, ctx())
    assert "management link" in p.failed


def test_no_rail_up_fails_in_a_cluster_and_skips_alone():
    down = {"present": True, "devices": [{**d, "up": False} for d in IB["devices"]]}
    facts = [(fabric_facts.Ibdev2netdev(), down), (fabric_facts.NetState(), net({"enp1s0f1np1": link(up=False), "enP2p1s0f1np1": link(up=False)})),
             (NETPLAN, {"exists": False})]
    assert "QSFP" in plan(fabric.FabricModule, {}, facts, ctx()).failed
    assert plan(fabric.FabricModule, {}, facts, ctx(play_hosts=("spark1",))).skipped


# -- mesh ---------------------------------------------------------------------------------

def exports_two(converged=True, subnet2="192.168.100.0/24"):
    def fab(n, sub):
        rails = [{"iface": "enp1s0f1np1", "address": f"192.168.100.1{n}", "prefix": 24, "subnet": sub,
                  "hca": "rocep1s0f1", "mtu": 9000, "up": True}]
        return {"rails": rails, **fabric_facts.nccl_settings(rails), "converged": converged}
    return {"spark1": {"fabric": fab(1, "192.168.100.0/24"), "ssh_mesh": {"converged": converged}},
            "spark2": {"fabric": fab(2, subnet2), "ssh_mesh": {"converged": converged}}}


def test_G32_mesh_jumbo_ping_failure_names_both_ends():
    host = ctx(exports=exports_two())
    m = fabric_mesh.FabricMeshModule()
    args = m.Args()
    probe = fabric_mesh._probe(args, host)
    assert probe.pings == (("192.168.100.11", "192.168.100.12"),) and probe.size == 8972
    res = {"ping": {"192.168.100.11 192.168.100.12": {"ok": False, "sent": 2, "received": 0,
                                                      "error": "ping: local error: message too long, mtu=1500"}},
           "ssh": {"192.168.100.12": {"ok": True, "error": None}}}
    p = m.plan(args, m.view(args, view([(probe, res)]), host), host)
    assert "spark1 -> spark2 on enp1s0f1np1" in p.failed and "message too long" in p.failed
    ok = {"ping": {"192.168.100.11 192.168.100.12": {"ok": True, "sent": 2, "received": 2, "error": None}},
          "ssh": {"192.168.100.12": {"ok": True, "error": None}}}
    good = m.plan(args, m.view(args, view([(probe, ok)]), host), host)
    assert good.exports["nccl"]["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1" and good.exports["fabric_verified"]


def exports_keyed(digest2="d2"):
    ex = exports_two()
    for n, d in (("spark1", "d1"), ("spark2", digest2)):
        ex[n]["ssh"] = {"pub": f"ssh-ed25519 AAAA{n}", "host_keys": [f"ssh-ed25519 HOST{n}"]}
        ex[n]["ssh_mesh"] = {"converged": True, "digest": d}
    return ex


def test_mesh_ssh_round_is_recorded_and_skipped_until_either_end_changes(tmp_path):
    """Issue 14: n x (n-1) logins only when something they depend on changed. A successful round
    is recorded under a key made of both ends' keys, pins and mesh files; the probe run with that
    record on the host logs in to no one; a peer's changed mesh files change the key."""
    from sparkprov.facts.base import ShellCtx
    from sparkprov.transport.local import LocalTransport

    m = fabric_mesh.FabricMeshModule()
    args = m.Args()
    host = ctx(exports=exports_keyed(), info={**SPARK_INFO, "home": str(tmp_path)})
    probe = fabric_mesh._probe(args, host)
    assert probe.proof_key and probe.ssh_targets == ("192.168.100.12",)
    ping_ok = {"192.168.100.11 192.168.100.12": {"ok": True, "sent": 2, "received": 2, "error": None}}
    logged_in = {"ping": ping_ok, "ssh": {"192.168.100.12": {"ok": True, "error": None}}, "ssh_proven": False}
    p = m.plan(args, m.view(args, view([(probe, logged_in)]), host), host)
    (record,) = p.changes
    assert record.become is False and record.touches == [probe]
    assert p.exports["fabric_verified"]
    # the recording script as the engine runs it, then the probe itself: no login, no @ssh lines
    assert LocalTransport("local").run_script(record.script).rc == 0
    assert (tmp_path / ".cache/sparkprov/mesh-ssh-proof").read_text() == probe.proof_key
    no_pings = fabric_mesh.MeshProbe((), 8972, "nobody", ("192.0.2.1",), probe.proof_key)  # TEST-NET: never reached
    out = LocalTransport("local").run_script(no_pings.command(ShellCtx(str(tmp_path)))).stdout
    assert out.strip() == "@ssh-proven"
    proven = no_pings.parse(out, "", 0)
    assert proven == {"ping": {}, "ssh": {}, "ssh_proven": True}
    again = m.plan(args, m.view(args, view([(probe, {"ping": ping_ok, "ssh": {}, "ssh_proven": True})]), host), host)
    assert not again.changes and "proven by an earlier round" in again.msg
    # either end changing what the logins depend on makes a new key; `ssh: always` never records
    assert fabric_mesh._probe(args, ctx(exports=exports_keyed(digest2="d2-new"))).proof_key != probe.proof_key
    assert fabric_mesh._probe(m.Args(ssh="always"), host).proof_key == ""
    no_mesh_export = exports_two()
    assert fabric_mesh._probe(args, ctx(exports=no_mesh_export)).proof_key == ""


def test_G33_mesh_subnet_disagreement_and_check_mode_skip():
    p = plan(fabric_mesh.FabricMeshModule, {}, [], ctx(exports=exports_two(subnet2="192.168.102.0/24")))
    assert "set fabric_subnets" in p.failed
    host = ctx(exports=exports_two(converged=False), check=True)
    assert fabric_mesh._probe(fabric_mesh.Args(), host) is None
    assert "check mode" in plan(fabric_mesh.FabricMeshModule, {}, [], host).skipped


def test_ssh_mesh_only_public_keys_and_pins_fabric_addresses():
    ex = exports_two()
    ex["spark2"]["ssh"] = {"user": "nvidia", "pub": "ssh-ed25519 AAAAPEER sparkprov-mesh@spark2",
                           "host_keys": ["ssh-ed25519 AAAAHOST2"], "converged": True}
    ak = {"path": "/etc/ssh/authorized_keys/nvidia", "exists": True, "owner": "root", "group": "root", "mode": 0o644,
          "content": "ssh-ed25519 AAAACTL sparkprov-lab\nssh-ed25519 AAAAOLD sparkprov-mesh@spark2\n"}
    facts = [(ssh_facts.AuthorizedKeys("nvidia"), ak),
             (PathState("~/.ssh/known_hosts", with_content=True), {"exists": True, "mode": 0o644,
                                                                   "content": b"192.168.100.12 ssh-ed25519 STALE\nother ssh-rsa K\n"}),
             (PathState("~/.ssh/config", with_content=True), {"exists": False})]
    p = plan(ssh_mesh.SshMeshModule, {}, facts, ctx(exports=ex))
    auth, kh, cfg = p.changes
    assert auth.diff.after == "ssh-ed25519 AAAACTL sparkprov-lab\nssh-ed25519 AAAAPEER sparkprov-mesh@spark2\n"
    assert kh.diff.after == "other ssh-rsa K\n192.168.100.12 ssh-ed25519 AAAAHOST2\n"
    assert "Host 192.168.100.12\n    IdentityFile ~/.ssh/id_ed25519_sparkprov" in cfg.diff.after
    assert all("PRIVATE" not in c.script for c in p.changes)
    assert ssh_mesh.config_after(cfg.diff.after, ["192.168.100.12"], "~/.ssh/id_ed25519_sparkprov") == cfg.diff.after


def test_mesh_logins_one_per_peer_in_an_order_rotated_per_host():
    """Issue 14: at 16 hosts every node checks every peer at once; each logs in once per peer
    (pings prove each rail) and starts at its own place in the ring, so that at any moment the
    logins go to different peers' sshd instead of all to the first one."""
    names = [f"spark{i}" for i in range(1, 17)]

    def fab(n):
        rails = [{"iface": iface, "address": f"192.168.{100 + r}.{10 + n}", "prefix": 24,
                  "subnet": f"192.168.{100 + r}.0/24", "hca": "x", "mtu": 9000, "up": True}
                 for r, iface in enumerate(("enp1s0f1np1", "enP2p1s0f1np1"))]
        return {"rails": rails, **fabric_facts.nccl_settings(rails), "converged": True}

    exports = {n: {"fabric": fab(i + 1), "ssh_mesh": {"converged": True}} for i, n in enumerate(names)}
    firsts, links = [], []
    for i, n in enumerate(names):
        probe = fabric_mesh._probe(fabric_mesh.Args(), ctx(name=n, exports=exports, play_hosts=tuple(names)))
        assert len(probe.ssh_targets) == 15  # one login per peer
        assert len(probe.pings) in (14, 16)  # a ping per rail to 7 or 8 peers: each pair once
        assert all(t.startswith("192.168.100.") for t in probe.ssh_targets)
        firsts.append(probe.ssh_targets[0])
        assert probe.ssh_targets[0] == f"192.168.100.{10 + (i + 1) % 16 + 1}"
        links += [(src.split(".")[2], frozenset((src.split(".")[3], dst.split(".")[3]))) for src, dst in probe.pings]
        for src, dst in probe.pings:
            assert src.split(".")[2] == dst.split(".")[2]  # from this host's address on the same rail
        # the peers this host does not ping are exactly those that ping it (the plan names them)
        pinged = {f"spark{int(dst.split('.')[3]) - 10}" for _, dst in probe.pings}
        by = fabric_mesh.checked_by(ctx(name=n, exports=exports, play_hosts=tuple(names)), exports)
        assert pinged.isdisjoint(by) and pinged | set(by) == set(names) - {n}
    # at the first step, the 16 hosts log in to 16 different peers
    assert len(set(firsts)) == 16
    # every pair of hosts, on each of the two rails, is pinged exactly once by the whole mesh
    assert len(links) == len(set(links)) == 2 * 16 * 15 // 2
