"""drift: the versions a node runs (kernel, driver, CUDA, ConnectX-7 firmware), recorded, checked against versions known
to break serving, and compared across the nodes of one deployment.

OS updates break clusters: after an NVIDIA system update, kernel 7.0.0-1019-nvidia made NCCL fail at
start on two Sparks (eugr/spark-vllm-docker#392). Two phases, each its own play (plays are barriers):

- `record` (provision's first play; cluster-up's versions play): reads the kernel (/proc/sys/kernel/
  osrelease, gathered with the host's identity), the driver and CUDA version (nvidia-smi), the
  ConnectX-7 firmware (/sys/class/infiniband/*/fw_ver) and the kernel command line; writes them to /var/lib/sparkprov/versions.json (`record: true`: a change
  with a before/after diff when they moved since the last provision); checks KNOWN_BAD (a warning;
  with `multinode: true` a row that breaks multi-node serving is exported as a refusal);
  exports `versions`.
- `compare` (the play after): the versions every host of the play exported; a difference is a
  warning naming each host's version. `strict: true`, as cluster-up runs it for a multi-node
  deployment: a difference or a refusal fails the task, every node's version named.
- `compare` with `nccl: true` (cluster-up's "same NCCL" play, after the image is on every node and
  image_nccl probed it): the NCCL each node's serving image loads (the system's or a pip wheel's, and
  its version); nodes that differ are a warning, with `strict` a refusal naming both. A node whose
  probe failed ("unknown") is a warning, never a refusal: the probe, not the node, may be at fault.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypedDict

from sparkprov.facts.files import PathState
from sparkprov.facts.fabric import RdmaFirmware, firmware_summary
from sparkprov.facts.hardware import KernelCmdline, NvidiaSmi
from sparkprov.modules._provision import write_file_script
from sparkprov.facts.nccl import NcclRecord, describe
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.modules.image_nccl import IMAGE_NCCL

VERSIONS_PATH = "/var/lib/sparkprov/versions.json"
# ConnectX-7 firmware: NCCL over RoCE runs on it, and an NVIDIA system update can move it with the
# kernel (28.45.4028 on the Sparks of geerlingguy/sbc-reviews#92 and dgx-spark-playbooks PR#108)
FIELDS = (("kernel", "kernel"), ("driver", "driver"), ("cuda", "CUDA"), ("firmware", "ConnectX-7 firmware"))

# Versions known to break serving on a Spark, each with its source. `multinode`: it breaks NCCL
# across nodes (a multi-node start is refused); `unless`: a kernel command line parameter that
# avoids it.
KNOWN_BAD: list[dict[str, Any]] = [
    {"field": "kernel", "version": "7.0.0-1019-nvidia", "multinode": True, "unless": "kho=off",
     "why": "NCCL over RoCE fails at start: `ibv_reg_mr_iova2 ... Cannot allocate memory` (ENOMEM)",
     "fix": "boot 6.17.0-1032-nvidia (still installed after the update), or add kho=off to the kernel "
            "command line",
     "source": "eugr/spark-vllm-docker#392; MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#14 (6.17.0-1032 works); "
               "MiaAI-Lab/DeepSeek-v4-Flash-DSpark-2x-DGX-Spark#259 (kho=off)"},
]


class Args(ModuleArgs):
    phase: Literal["record", "compare"] = "record"
    record: bool = True        # record: write versions.json on the node
    multinode: bool = False    # record: a KNOWN_BAD row that breaks multi-node serving fails the task
    strict: bool = False       # compare: a difference fails the task
    nccl: bool = False         # compare: the NCCL each node's image loads (image_nccl), not the versions


def versions_of(info: dict[str, str], smi: dict[str, Any], rdma: dict[str, str] | None = None) -> dict[str, str | None]:
    return {"firmware": firmware_summary(rdma or {}), "kernel": info.get("kernel") or None, "driver": smi.get("driver_version") if smi.get("present") else None,
            "cuda": smi.get("cuda_version") if smi.get("present") else None}


def versions_line(versions: dict[str, Any]) -> str:
    """`kernel X, driver Y, CUDA Z, ConnectX-7 firmware W`; a version the host lacks is left out."""
    return ", ".join(f"{label} {versions[k]}" for k, label in FIELDS if versions.get(k) is not None)


def known_bad(versions: dict[str, Any], params: dict[str, Any], *, multinode: bool) -> tuple[list[str], list[str]]:
    """(failures, warnings) for the node's versions against KNOWN_BAD. Pure."""
    fails, warns = [], []
    for row in KNOWN_BAD:
        if versions.get(row["field"]) != row["version"]:
            continue
        key, _, val = (row.get("unless") or "").partition("=")
        if key and key in params and (params[key] or "") == val:
            continue
        line = (f"{dict(FIELDS)[row['field']]} {row['version']} is known to break serving: {row['why']} "
                f"(fix: {row['fix']}; source: {row['source']})")
        (fails if multinode and row["multinode"] else warns).append(line)
    return fails, warns


def differences(seen: dict[str, dict[str, Any]]) -> list[str]:
    """One line per version that differs between hosts, naming every host's version. Pure."""
    out = []
    for key, label in FIELDS:
        values = {h: (v or {}).get(key) for h, v in sorted(seen.items())}
        if len(set(values.values())) > 1:
            out.append(f"{label} differs: " + ", ".join(f"{h} {v or 'unknown'}" for h, v in values.items()))
    return out


def nccl_differences(seen: dict[str, dict[str, NcclRecord]]) -> tuple[list[str], list[str]]:
    """(differences, unknowns) of the NCCL each host's images load (host -> image -> record): one line
    naming every host's NCCL where the known ones differ (source or version); one line per host whose
    probe failed. Pure."""
    known: dict[str, tuple] = {}
    unknown = []
    for h, recs in sorted(seen.items()):
        if any(r.get("source") == "unknown" for r in recs.values()):
            unknown.extend(f"{h}: {ref}: {describe(r)}" for ref, r in sorted(recs.items()) if r.get("source") == "unknown")
            continue
        known[h] = tuple(sorted((r.get("source"), r.get("version")) for r in recs.values()))
    if len(set(known.values())) <= 1:
        return [], unknown
    line = ", ".join(f"{h} " + " + ".join(describe(r) for _, r in sorted(seen[h].items())) for h in known)
    return [f"NCCL differs: {line}"], unknown


class Versions(TypedDict):
    kernel: str | None
    driver: str | None
    cuda: str | None
    firmware: str | None   # the ConnectX-7 firmware


VERSIONS: Export[Versions] = Export("versions", Versions, "the node's kernel, driver, CUDA and ConnectX-7 firmware")
VERSIONS_REFUSED: Export[list[str]] = Export("versions_refused", list,
                                            "a KNOWN_BAD version here that the compare play refuses, one line each")


class DriftModule(Module):
    name = "drift"
    Args = Args
    doc = "Record kernel, driver, CUDA and ConnectX-7 firmware; refuse known-bad versions and nodes of one deployment that differ."

    def needs(self, args: Args, host: HostContext):
        if args.phase == "compare":
            return {}
        named = {"smi": NvidiaSmi(), "cmdline": KernelCmdline(), "rdma": RdmaFirmware()}
        if args.record:   # the record is root's: only provision (become) reads and writes it
            named["file"] = PathState(VERSIONS_PATH, with_content=True)
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        if args.phase == "compare" and args.nccl:
            return compare_nccl(args, host)
        if args.phase == "compare":
            seen = VERSIONS.of_play(host)
            if host.name not in seen:
                return Plan.skip("no versions recorded for this host (the record phase did not run)")
            diffs = differences(seen)
            refused = [r for rs in VERSIONS_REFUSED.of_play(host).values() for r in rs]
            if (diffs or refused) and args.strict:
                return Plan.fail("; ".join(([f"the nodes run different versions: {'; '.join(diffs)} (fix: update every "
                                             "node to one kernel, driver, CUDA and ConnectX-7 firmware, then invoke "
                                             "provision)"] if diffs else [])
                                           + refused))
            return Plan(msg=f"{len(seen)} host(s) run the same kernel, driver and CUDA" if not diffs else "",
                        warnings=[f"drift: {d}" for d in diffs])
        versions = versions_of(host.info, facts.smi, facts.rdma)
        fails, warns = known_bad(versions, facts.cmdline.get("params") or {}, multinode=args.multinode)
        # the refusal waits for the compare play, which names every node's versions with it
        exports = {**VERSIONS(versions), **VERSIONS_REFUSED([f"{host.name}: {f}" for f in fails])}
        if not args.record:
            return Plan(msg=versions_line(versions), warnings=warns, exports=exports)
        text = json.dumps(versions, indent=2, sort_keys=True) + "\n"
        have = facts.file
        before = (have.get("content") or b"").decode("utf-8", "replace") if have.get("exists") else ""
        changes = []
        if before != text:
            script = write_file_script(VERSIONS_PATH, text.encode(), mode="0644", umask="022")
            old = json.loads(before) if before.strip().startswith("{") else {}
            # a field an older record lacks (the firmware, recorded since) is new, not moved
            moved = [f"{label} {old[k]} -> {versions[k]}" for k, label in FIELDS if k in old and old[k] != versions[k]]
            summary = (f"record versions: {', '.join(moved)} (changed since the last provision)" if moved
                       else f"record versions in {VERSIONS_PATH}")
            changes.append(Change(summary, script, Diff(VERSIONS_PATH, before, text), [facts.fact("file")]))
            if moved:
                warns.append(f"{host.name}: " + ", ".join(moved) + " since the last provision")
        return Plan(changes, msg=versions_line(versions), warnings=warns,
                    exports=exports)


def compare_nccl(args: Args, host: HostContext) -> Plan:
    seen = IMAGE_NCCL.of_play(host)
    if host.name not in seen:
        return Plan.skip("no NCCL recorded for this host's image (not probed: check mode, or the image is not here)")
    diffs, unknown = nccl_differences(seen)
    if diffs and args.strict:
        return Plan.fail(f"the nodes' images load different NCCL: {'; '.join(diffs)} (fix: run one image build on "
                         "every node: the same tag and digest, or one registry's image, then invoke cluster-up)",
                         warnings=[f"drift: {u}" for u in unknown])
    return Plan(msg=f"{len(seen)} host(s) load the same NCCL: {describe(next(iter(seen[host.name].values()), None))}"
                if not diffs else "", warnings=[f"drift: {d}" for d in diffs + unknown])
