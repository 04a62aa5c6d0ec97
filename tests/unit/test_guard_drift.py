"""The drift gate (sparkprov/modules/drift.py), planned from literal facts: versions recorded with a
before/after diff, the known-bad kernel of eugr/spark-vllm-docker#392 warned at provision and refused
for a multi-node start (unless kho=off), nodes of one deployment that differ refused with both named."""

from __future__ import annotations

import hashlib
import json

from sparkprov.facts.files import PathState
from sparkprov.facts.fabric import RdmaFirmware
from sparkprov.facts.hardware import KernelCmdline, NvidiaSmi, parse_cmdline
from sparkprov.modules import drift
from sparkprov.modules.base import FactView, HostContext

# kernel and driver of the Sparks in MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#14 (the working boot)
GOOD = "6.17.0-1032-nvidia"
BAD = "7.0.0-1019-nvidia"
SMI = {"present": True, "driver_version": "580.173.02", "cuda_version": "13.0", "gpus": []}
# the four ConnectX-7 functions and their firmware as `ibstat` printed them on a GB10
# (gb10-failure-outputs.md §4.1: geerlingguy/sbc-reviews#92, dell-gb10-1)
IBSTAT_FW = {"roceP2p1s0f0": "28.45.4028", "roceP2p1s0f1": "28.45.4028", "rocep1s0f0": "28.45.4028",
             "rocep1s0f1": "28.45.4028"}
VERSIONS = {"kernel": GOOD, "driver": "580.173.02", "cuda": "13.0", "firmware": "28.45.4028"}


def ctx(name="spark1", kernel=GOOD, exports=None, play_hosts=("spark1", "spark2")):
    return HostContext(name, {}, {"user": "nvidia", "home": "/home/nvidia", "kernel": kernel}, check=False,
                       exports=exports or {h: {} for h in play_hosts}, play_hosts=list(play_hosts), become=True)


def plan(args, host, *, cmdline="ro quiet splash", recorded=None, rdma=IBSTAT_FW):
    m = drift.DriftModule()
    a = m.Args.model_validate(args)
    values = {NvidiaSmi().key: SMI, KernelCmdline().key: parse_cmdline(cmdline), RdmaFirmware().key: rdma}
    if recorded is None:
        values[PathState(drift.VERSIONS_PATH, with_content=True).key] = {"exists": False}
    else:
        data = recorded.encode()
        values[PathState(drift.VERSIONS_PATH, with_content=True).key] = {
            "exists": True, "type": "file", "mode": 0o644, "owner": "root", "group": "root", "size": len(data),
            "content": data, "sha256": hashlib.sha256(data).hexdigest()}
    return m.plan(a, m.view(a, FactView(values, {}), host), host)


def test_provision_records_versions_and_reports_a_kernel_that_moved():
    p = plan({}, ctx())
    (c,) = p.changes
    assert json.loads(c.diff.after) == VERSIONS
    assert p.exports["versions"]["kernel"] == GOOD and not p.warnings
    assert plan({}, ctx(), recorded=c.diff.after).changes == []
    # the update: the record moves, a warning says from what to what, and the known-bad row warns
    moved = plan({}, ctx(kernel=BAD), recorded=c.diff.after)
    assert moved.changes[0].summary.startswith(f"record versions: kernel {GOOD} -> {BAD}")
    assert any("eugr/spark-vllm-docker#392" in w and "ibv_reg_mr_iova2" in w for w in moved.warnings)
    assert any(f"kernel {GOOD} -> {BAD} since the last provision" in w for w in moved.warnings)


def test_known_bad_kernel_refuses_a_multinode_start_unless_kho_off():
    p = plan({"record": False, "multinode": True}, ctx(kernel=BAD))
    (refusal,) = p.exports["versions_refused"]
    assert p.failed is None and p.changes == []
    assert refusal.startswith(f"spark1: kernel {BAD} is known to break serving") and "kho=off" in refusal
    ok = plan({"record": False, "multinode": True}, ctx(kernel=BAD), cmdline="ro quiet kho=off")
    assert ok.exports["versions_refused"] == []
    # the compare play refuses it, with every node's versions
    v = p.exports["versions"]
    exports = {"spark1": {"versions": v, "versions_refused": [refusal]},
               "spark2": {"versions": {**v, "kernel": GOOD}, "versions_refused": []}}
    failed = plan({"phase": "compare", "strict": True}, ctx(exports=exports)).failed
    assert failed.startswith(f"the nodes run different versions: kernel differs: spark1 {BAD}, spark2 {GOOD}")
    assert failed.endswith(refusal)


def test_nodes_that_differ_are_named_with_both_versions():
    exports = {"spark1": {"versions": VERSIONS}, "spark2": {"versions": {**VERSIONS, "kernel": BAD}}}
    strict = plan({"phase": "compare", "strict": True}, ctx(exports=exports))
    assert strict.failed == (f"the nodes run different versions: kernel differs: spark1 {GOOD}, spark2 {BAD} "
                             "(fix: update every node to one kernel, driver, CUDA and ConnectX-7 firmware, then invoke provision)")
    warned = plan({"phase": "compare"}, ctx(exports=exports))
    assert warned.failed is None and warned.warnings == [f"drift: kernel differs: spark1 {GOOD}, spark2 {BAD}"]
    same = {h: {"versions": exports["spark1"]["versions"]} for h in exports}
    assert plan({"phase": "compare", "strict": True}, ctx(exports=same)).failed is None


def test_firmware_is_recorded_and_a_node_whose_firmware_moved_is_named():
    """The ConnectX-7 firmware read from sysfs (what ibstat prints as "Firmware version"): one version
    when the four functions agree; a node on another firmware is a difference like a kernel's."""
    from sparkprov.facts.fabric import firmware_summary, parse_rdma_firmware

    read = parse_rdma_firmware("".join(f"{d} {v}\n" for d, v in IBSTAT_FW.items()))
    assert read == IBSTAT_FW and firmware_summary(read) == "28.45.4028"
    assert firmware_summary({}) is None
    mixed = {**IBSTAT_FW, "rocep1s0f1": "28.44.1036"}
    assert firmware_summary(mixed).startswith("roceP2p1s0f0 28.45.4028, ")
    p = plan({}, ctx())
    assert p.msg.endswith("ConnectX-7 firmware 28.45.4028")
    # a record made before the firmware was recorded: the firmware is new, not moved
    old = json.dumps({k: v for k, v in VERSIONS.items() if k != "firmware"})
    assert not any("since the last provision" in w for w in plan({}, ctx(), recorded=old).warnings)
    # no RDMA device (the lab): the version is left out of the line, not printed as None
    assert "firmware" not in plan({}, ctx(), rdma={}).msg
    exports = {"spark1": {"versions": VERSIONS}, "spark2": {"versions": {**VERSIONS, "firmware": "28.44.1036"}}}
    failed = plan({"phase": "compare", "strict": True}, ctx(exports=exports)).failed
    assert failed.startswith("the nodes run different versions: ConnectX-7 firmware differs: "
                             "spark1 28.45.4028, spark2 28.44.1036")
