"""fabric_qualify: what each rail really carries, measured at provision, recorded on the node.

The fabric can say 200G and not carry it: ConnectX-7 links stuck near 13 Gb/s with the link up and
ethtool reporting 200000Mb/s (NVIDIA/dgx-spark-playbooks PR#108), half speed with one of a port's
two HCAs in NCCL_IB_HCA (#102). So, per rail of this host (the fabric module's, in the play after
fabric_mesh has proven the mesh):

- throughput: `ib_write_bw` (perftest, as NVIDIA's performance guide measures the link) from this
  host to the next host of the ring on that rail: its server started on the peer over the mesh SSH,
  the client run here against the peer's rail address for `seconds` (facts/rail.py
  RailThroughput). Each host measures what it sends; the peer measures the other direction. Judged
  against the floor (`rail_min_gbps`, default 46: fails) and the expected figure
  (`rail_expected_gbps`, default 90: a warning), each default with its source in facts/rail.py;
- MTU 9000 on both ends (read on each end during the measurement);
- NCCL_IB_HCA as sparkprov sets it for serving (the `ib_hcas` variable, else every rail's HCA) names
  both halves of each cabled port.

A measurement is a read: it writes nothing on either host and changes no setting (the peer's server
exits after its one test); it loads the rail for `seconds` per rail, so check mode measures too.
What it found is recorded in /var/lib/sparkprov/fabric/qualification.json (mode 0644, as root: the
guard and cluster-up's preflight read it), rewritten when a verdict changes or a figure moves by
more than RECORD_TOLERANCE (a second provision over the same links changes nothing). A degraded rail
fails the task naming the rail, the figure, the floor and the fix (after it is recorded);
`cluster-up` refuses a multi-node start over a node whose record says degraded unless forced
(serve_preflight). The record also holds this measurement as the node guard runs it again after
every boot (`remeasure`: login user, command text, MTUs; node/requalify.py). Exports
`fabric_qualification`: {ok, rails}.
"""

from __future__ import annotations

import json
import time
from typing import Any, TypedDict

from pydantic import Field

from sparkprov.facts.base import ShellCtx
from sparkprov.facts.fabric import Ibdev2netdev
from sparkprov.facts.rail import (EXPECTED_GBPS, MIN_GBPS, QUAL_PATH, QualificationRecord, RailThroughput,
                                  ib_hca_problems, judge_rail)
from sparkprov.modules._provision import setting, write_file_script
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.modules.fabric_mesh import ring
from sparkprov.modules.fabric import FABRIC
from sparkprov.modules.ssh_mesh import SSH_MESH

# A figure within this share of the recorded one is the same link: the record is rewritten only when
# a verdict changes or a figure moves further, so that a provision over unchanged links changes
# nothing. On a Spark the verdict moves first (a rail that loses half of 92 Gb/s is degraded); on the
# lab's veths, where the two hosts measure at once on two shared cores, one rail read 13.97 Gb/s in one
# provision and 23.39 in the next (docs/fabric.md).
RECORD_TOLERANCE = 0.5
COMPARED = ("iface", "hca", "peer", "peer_addr", "status", "mtu", "peer_mtu", "floor_gbps", "expected_gbps")
# Compared whole: a record without the guard's measurement (written before the guard re-measured
# after a boot) is rewritten once.
COMPARED_TOP = ("nccl_ib_hca", "nccl_problems", "seconds", "qps", "remeasure")


class Args(ModuleArgs):
    seconds: int = Field(default=3, ge=1, le=60)          # per rail
    port: int = Field(default=18515, ge=1024, le=65000)   # perftest's default; rail i uses port + i
    qps: int = Field(default=1, ge=1, le=16)              # the healthy reference figures are 1 QP
    min_gbps: float | None = Field(default=None, gt=0)       # default: `rail_min_gbps`, else MIN_GBPS
    expected_gbps: float | None = Field(default=None, gt=0)  # default: `rail_expected_gbps`, else EXPECTED_GBPS
    record: bool = True


def peer_of(host: HostContext, fabrics: dict[str, Any]) -> str:
    """The host this one measures against: the next of the ring (each host sends to one, receives from one)."""
    names = ring(host, fabrics)
    return names[(names.index(host.name) + 1) % len(names)]


def _pending(host: HostContext) -> list[str]:
    if not host.check:
        return []
    return sorted({h for x in (FABRIC, SSH_MESH) for h, v in x.of_play(host).items()
                   if not v.get("converged", True)})


def _thresholds(args: Args, host: HostContext) -> tuple[float, float]:
    floor = setting(args.min_gbps, host, "rail_min_gbps", MIN_GBPS)
    expected = setting(args.expected_gbps, host, "rail_expected_gbps", EXPECTED_GBPS)
    for var, v in (("rail_min_gbps", floor), ("rail_expected_gbps", expected)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"inventory var {var}: a figure in Gb/s above 0, got {v!r}")
    if floor > expected:
        raise ValueError(f"rail_min_gbps {floor:g} is above rail_expected_gbps {expected:g}: the floor must be the lower")
    return float(floor), float(expected)


def named_hcas(host: HostContext, fabric: dict[str, Any]) -> list[str]:
    """NCCL_IB_HCA as serving sets it on this host (serving/node.py): `ib_hcas`, else every rail's HCA."""
    v = host.vars.get("ib_hcas")
    if v:
        return [s.strip() for s in (v.split(",") if isinstance(v, str) else map(str, v)) if s.strip()]
    return [h for h in (fabric.get("nccl_ib_hca") or "").split(",") if h]


def same_record(before: dict[str, Any] | None, after: dict[str, Any], tolerance: float = RECORD_TOLERANCE) -> bool:
    """Whether the record on the node says what this measurement says: the same rails, peers, verdicts,
    MTUs, thresholds and NCCL_IB_HCA, each figure within `tolerance` of the recorded one. Pure."""
    if not before or not before.get("present"):
        return False
    if any(before.get(k) != after.get(k) for k in COMPARED_TOP):
        return False
    rb, ra = before.get("rails") or [], after["rails"]
    if len(rb) != len(ra):
        return False
    for b, a in zip(rb, ra):
        if any(b.get(k) != a.get(k) for k in COMPARED):
            return False
        gb, ga = b.get("gbps"), a.get("gbps")
        if (gb is None) != (ga is None) or (gb is not None and abs(ga - gb) > tolerance * max(gb, ga)):
            return False
    return True


def record_script(text: str) -> str:
    """Write the record atomically, readable by all (the login user's preflight reads it): its
    directory 0755, not the 0700 a umask 077 would make."""
    return write_file_script(QUAL_PATH, text.encode(), mode="0644", umask="022")


class Qualification(TypedDict):
    ok: bool
    rails: list[dict[str, Any]]   # facts/rail.py judge_rail: iface, peer, gbps, mtu, status, problem


FABRIC_QUALIFICATION: Export[Qualification] = Export("fabric_qualification", Qualification,
                                                     "each rail's measured throughput, judged against the floor")


def throughput_fact(args: Args, host: HostContext, fabrics: dict[str, Any]) -> RailThroughput:
    """The measurement from this host to its ring peer, rail by rail (the peer's address, iface and HCA)."""
    peer = fabrics[peer_of(host, fabrics)]
    rails = tuple((r["iface"], r.get("hca") or "", p["address"], p["iface"], p.get("hca") or "")
                  for r, p in zip(fabrics[host.name]["rails"], peer["rails"]))
    return RailThroughput(rails, host.user, args.seconds, args.port, args.qps)


def remeasure(args: Args, host: HostContext, fabrics: dict[str, Any]) -> dict[str, Any]:
    """What the node guard (node/guard.py, which imports nothing of sparkprov beyond node/) needs to run this
    very measurement again after a boot: the login user whose mesh SSH it goes over, the command text as
    provision runs it, and the MTU each rail must have."""
    return {"user": host.user, "command": throughput_fact(args, host, fabrics).command(ShellCtx(None)),
            "rails": [{"iface": r["iface"], "mtu": r.get("mtu") or 9000} for r in fabrics[host.name]["rails"]]}


class FabricQualifyModule(Module):
    name = "fabric_qualify"
    Args = Args
    doc = ("Measure each rail's throughput (ib_write_bw to a peer over the mesh SSH), MTU on both ends and "
           "NCCL_IB_HCA; record it; fail a degraded rail naming the figure, the floor and the fix.")

    def needs(self, args: Args, host: HostContext):
        fabrics = FABRIC.of_play(host)
        mine = fabrics.get(host.name)
        if not mine or len(fabrics) < 2 or _pending(host):
            return {}
        named = {"bw": throughput_fact(args, host, fabrics), "ib": Ibdev2netdev()}
        if args.record:
            named["record"] = QualificationRecord()
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        h = host.name
        fabrics = FABRIC.of_play(host)
        mine = fabrics.get(h)
        if not mine:
            return Plan.skip("no fabric configured on this host")
        if len(fabrics) < 2:
            return Plan.skip("single host: no peer to measure a rail against")
        pending = _pending(host)
        if pending:
            return Plan.skip(f"check mode: fabric/ssh changes pending on {', '.join(pending)}; the rails are measured "
                             "once they are applied")
        try:
            floor, expected = _thresholds(args, host)
        except ValueError as e:
            return Plan.fail(f"{h}: {e}")
        peer = peer_of(host, fabrics)
        measured = facts.bw
        results = []
        for r, p in zip(mine["rails"], fabrics[peer]["rails"]):
            m = measured.get(r["iface"]) or {"error": "no measurement came back"}
            results.append(judge_rail({**m, "iface": r["iface"], "hca": r.get("hca"), "peer": peer,
                                       "peer_addr": p["address"]}, floor=floor, expected=expected, mtu=r.get("mtu") or 9000))
        named = named_hcas(host, mine)
        nccl = ib_hca_problems(named, facts.ib["devices"])
        doc = {"version": 1, "tool": "ib_write_bw", "seconds": args.seconds, "qps": args.qps,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "floor_gbps": floor,
               "expected_gbps": expected, "rails": results, "nccl_ib_hca": ",".join(named) or None,
               "nccl_problems": nccl, "remeasure": remeasure(args, host, fabrics),
               "ok": not nccl and all(r["status"] != "degraded" for r in results)}
        fails = [r["problem"] for r in results if r["status"] == "degraded"] + [f"{h}: {p}" for p in nccl]
        warns = [r["problem"] for r in results if r["status"] in ("slow", "unmeasured")]
        msg = "; ".join(f"{r['iface']} {r['gbps']:g} Gb/s to {peer}" if r["gbps"] is not None else f"{r['iface']} {r['status']}"
                        for r in results) + f" (floor {floor:g}, expected {expected:g} Gb/s, ib_write_bw {args.seconds}s "
        msg += f"{args.qps} QP); MTU {', '.join(str(r['mtu']) for r in results)}"
        exports = FABRIC_QUALIFICATION({"ok": doc["ok"], "rails": results})
        changes = []
        if args.record:
            have = facts.record
            if not same_record(have, doc):
                text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
                before = json.dumps({k: v for k, v in have.items() if k != "present"}, indent=2, sort_keys=True) + "\n" \
                    if have.get("present") else ""
                verdict = "degraded" if not doc["ok"] else "ok"
                changes.append(Change(f"record the qualification ({verdict}) in {QUAL_PATH}",
                                      record_script(text),
                                      Diff(QUAL_PATH, before, text), [facts.fact("record")], become=True,
                                      predicts=[(facts.fact("record"), {"present": True, **doc})]))
        if fails and (host.check or not changes):
            # applied changes are verified by planning again: that plan fails with the same lines
            return Plan.fail("; ".join(fails) + (f" (would record it in {QUAL_PATH})" if changes else ""),
                             warnings=warns, exports=exports)
        return Plan(changes, msg=msg, warnings=warns, exports=exports)
