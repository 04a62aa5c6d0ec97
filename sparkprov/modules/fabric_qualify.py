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
guard and cluster-up's preflight read it), with when and why it was measured.

Measuring costs `seconds` per rail on every host (6 s of a 2-rail Spark, the whole of a no-op
provision), so it runs only when the figure may have moved (`why_measure`): the first time; when
something it depends on changed (the key: both ends' rails, addresses, MTU, HCAs and peers, both
ends' driver and ConnectX-7 firmware, the thresholds and the tool's settings); in a boot nobody
qualified yet (the node guard re-measures after every boot and records the boot it measured in);
when the record is older than `fabric_qualify_max_age_hours` (168); when the last verdict was not ok
(a rail that failed is measured until it passes); or when asked (`fabric_requalify: true`, or
delete the record). What it depends on is read in provision's first play by the `state` phase of
this module (the record, the boot, the driver and firmware: facts that play reads anyway), so a
qualification that stands costs no remote call of its own. A measured record that says what the
standing one says (a failed rail failing again within RECORD_TOLERANCE) is not rewritten. A degraded rail
fails the task naming the rail, the figure, the floor and the fix (after it is recorded);
`cluster-up` refuses a multi-node start over a node whose record says degraded unless forced
(serve_preflight). The record also holds this measurement as the node guard runs it again after
every boot (`remeasure`: login user, command text, MTUs; node/requalify.py). Exports
`fabric_qualification`: {ok, rails}.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import time
from typing import Any, Literal, TypedDict

from pydantic import Field

from sparkprov import inventory_vars as iv
from sparkprov.facts.base import ShellCtx
from sparkprov.facts.fabric import Ibdev2netdev, RdmaFirmware, firmware_summary
from sparkprov.facts.hardware import BootId, NvidiaSmi
from sparkprov.facts.topology import SPARK_TWINS
from sparkprov.facts.rail import (QUAL_PATH, QualificationRecord, RailThroughput,
                                  ib_hca_problems, judge_rail)
from sparkprov.modules._provision import setting, write_file_script
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.modules.fabric_mesh import per_link, ring
from sparkprov.modules.fabric import FABRIC, play_fabric
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
# How old a standing qualification may grow before it is measured again: sparkprov's choice, a week.
# A cable that degrades with no boot, no recabling and no update is caught within it; the guard
# measures after every boot, and what the figure depends on is compared on every provision.
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class Args(ModuleArgs):
    # state: read what a qualification depends on (provision's first play); measure: qualify
    phase: Literal["state", "measure"] = "measure"
    requalify: bool | None = None      # default: `fabric_requalify`, else False (measure when due)
    max_age_hours: float | None = Field(default=None, gt=0)  # default: `fabric_qualify_max_age_hours`
    seconds: int = Field(default=3, ge=1, le=60)          # per rail
    port: int = Field(default=18515, ge=1024, le=65000)   # perftest's default; rail i uses port + i
    qps: int = Field(default=1, ge=1, le=16)              # the healthy reference figures are 1 QP
    min_gbps: float | None = Field(default=None, gt=0)       # default: the `rail_min_gbps` variable
    expected_gbps: float | None = Field(default=None, gt=0)  # default: the `rail_expected_gbps` variable
    record: bool = True


def peer_of(host: HostContext, fabrics: dict[str, Any]) -> str:
    """The host this one measures against: the next of the ring (each host sends to one, receives from one)."""
    names = ring(host, fabrics)
    return names[(names.index(host.name) + 1) % len(names)]


def rail_peers(host: HostContext, fabrics: dict[str, Any]) -> list[tuple[dict, str, dict]]:
    """(this host's rail, the peer it measures to, the peer's rail). On a mesh or a ring each rail is a
    link and goes to its own peer (each end measures what it sends: every link, both directions); on
    a pair or a switch rail i goes to rail i of the next host of the ring."""
    links = per_link(fabrics, host)
    if links is not None:
        return links
    peer = peer_of(host, fabrics)
    return [(r, peer, p) for r, p in zip(fabrics[host.name]["rails"], fabrics[peer]["rails"])]


def _pending(host: HostContext) -> list[str]:
    if not host.check:
        return []
    return sorted({h for x in (FABRIC, SSH_MESH) for h, v in x.of_play(host).items()
                   if not v.get("converged", True)})


def _thresholds(args: Args, host: HostContext) -> tuple[float, float]:
    floor = setting(args.min_gbps, host, "rail_min_gbps")
    expected = setting(args.expected_gbps, host, "rail_expected_gbps")
    if floor > expected:
        raise ValueError(f"rail_min_gbps {floor:g} is above rail_expected_gbps {expected:g}: the floor must be the lower")
    return float(floor), float(expected)


def named_hcas(host: HostContext, fabric: dict[str, Any]) -> list[str]:
    """NCCL_IB_HCA as serving sets it on this host (serving/node.py): `ib_hcas`, else every rail's HCA."""
    named = iv.value(host.vars, "ib_hcas")
    if named:
        return named
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


class QualState(TypedDict):
    record: dict[str, Any] | None   # the node's record (None: none)
    boot_id: str
    driver: str | None
    firmware: str | None


QUAL_STATE: Export[QualState] = Export("fabric_qualification_state", QualState,
                                       "the standing qualification record and what it depends on, read early")


def inputs_of(args: Args, host: HostContext, fabrics: dict[str, Any], floor: float, expected: float
              ) -> dict[str, Any]:
    """What this host's figures depend on, as the record keeps it (its digest is the record's key):
    per rail both ends' interface, HCA, address, MTU and host; both ends' driver and firmware (from
    the state phase; None where it was not read); the thresholds and how ib_write_bw is run."""
    pairs = rail_peers(host, fabrics)
    rails = [{"iface": r["iface"], "hca": r.get("hca"), "address": f"{r['address']}/{r['prefix']}",
              "mtu": r.get("mtu"), "peer": peer, "peer_iface": p["iface"], "peer_hca": p.get("hca"),
              "peer_address": p["address"], "peer_mtu": p.get("mtu")} for r, peer, p in pairs]
    versions = {}
    for h in [host.name] + sorted({peer for _, peer, _ in pairs}):
        st = QUAL_STATE.read(host.exports, h) or {}
        versions[h] = {"driver": st.get("driver"), "firmware": st.get("firmware")}
    return {"rails": rails, "versions": versions, "floor_gbps": floor, "expected_gbps": expected,
            "tool": {"seconds": args.seconds, "qps": args.qps, "port": args.port}}


def key_of(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _changed(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Which of the inputs moved, in words (for the record's reason and the run's message)."""
    out = []
    if before.get("rails") != after["rails"]:
        out.append("the rails (links, addresses, MTU or peers)")
    for h, now in sorted(after["versions"].items()):
        was = (before.get("versions") or {}).get(h) or {}
        for k in ("driver", "firmware"):
            if was.get(k) != now.get(k):
                out.append(f"{h}'s {k} {was.get(k)} -> {now.get(k)}")
    if (before.get("floor_gbps"), before.get("expected_gbps"), before.get("tool")) != \
            (after["floor_gbps"], after["expected_gbps"], after["tool"]):
        out.append("the thresholds or the measurement's settings")
    return ", ".join(out) or "what the figure depends on"


def why_measure(record: dict[str, Any] | None, inputs: dict[str, Any], boot_id: str | None, now: float, *,
                max_age_hours: float, asked: bool) -> str | None:
    """Why the rails must be measured now, or None when the standing record still holds. Pure."""
    if asked:
        return "asked (fabric_requalify)"
    if not record or not record.get("present", True):
        return "no qualification recorded on this node"
    if not record.get("key"):
        return "the record was written before qualifications were keyed"
    if record["key"] != key_of(inputs):
        return "changed since the last qualification: " + _changed(record.get("inputs") or {}, inputs)
    if boot_id and record.get("boot_id") != boot_id:
        return f"this boot ({boot_id}) is not qualified: the record is from boot {record.get('boot_id')}"
    try:
        age = (now - calendar.timegm(time.strptime(str(record.get("measured_at")), TIME_FORMAT))) / 3600
    except ValueError:
        return f"the record's time {record.get('measured_at')!r} cannot be read"
    if age > max_age_hours:
        return f"the record is {age:.0f} h old (fabric_qualify_max_age_hours {max_age_hours:g})"
    if not record.get("ok", False):
        return "the last qualification did not pass"
    return None


class Qualification(TypedDict):
    ok: bool
    rails: list[dict[str, Any]]   # facts/rail.py judge_rail: iface, peer, gbps, mtu, status, problem


FABRIC_QUALIFICATION: Export[Qualification] = Export("fabric_qualification", Qualification,
                                                     "each rail's measured throughput, judged against the floor")


def throughput_fact(args: Args, host: HostContext, fabrics: dict[str, Any]) -> RailThroughput:
    """The measurement from this host to each rail's peer, rail by rail (the peer's address, iface and HCA)."""
    pairs = rail_peers(host, fabrics)
    rails = tuple((r["iface"], r.get("hca") or "", p["address"], p["iface"], p.get("hca") or "") for r, _, p in pairs)
    ports = tuple(args.port + SPARK_TWINS.index(p["iface"]) if p["iface"] in SPARK_TWINS else args.port + i
                  for i, (r, _, p) in enumerate(pairs)) if any(r.get("peer") for r, _, _ in pairs) else ()
    return RailThroughput(rails, host.user, args.seconds, args.port, args.qps, ports)


def remeasure(args: Args, host: HostContext, fabrics: dict[str, Any]) -> dict[str, Any]:
    """What the node guard (node/guard.py, which imports nothing of sparkprov beyond node/) needs to run this
    very measurement again after a boot: the login user whose mesh SSH it goes over, the command text as
    provision runs it, and the MTU each rail must have."""
    return {"user": host.user, "command": throughput_fact(args, host, fabrics).command(ShellCtx(None)),
            "rails": [{"iface": r["iface"], "mtu": r.get("mtu") or 9000} for r in fabrics[host.name]["rails"]]}


def _max_age(args: Args, host: HostContext) -> float:
    return float(setting(args.max_age_hours, host, "fabric_qualify_max_age_hours"))


def _asked(args: Args, host: HostContext) -> bool:
    return bool(setting(args.requalify, host, "fabric_requalify"))


def due(args: Args, host: HostContext, fabrics: dict[str, Any]) -> str | None:
    """Why this host measures in this run (None: its standing record holds). A host whose state was
    not read in an earlier play (a playbook without the state phase) measures, as before."""
    state = QUAL_STATE.read(host.exports, host.name)
    floor, expected = _thresholds(args, host)
    if state is None:
        return "the standing qualification was not read (no fabric_qualify phase: state in an earlier play)"
    return why_measure(state["record"], inputs_of(args, host, fabrics, floor, expected), state["boot_id"],
                       time.time(), max_age_hours=_max_age(args, host), asked=_asked(args, host))


class FabricQualifyModule(Module):
    name = "fabric_qualify"
    Args = Args
    doc = ("Measure each rail's throughput (ib_write_bw to a peer over the mesh SSH), MTU on both ends and "
           "NCCL_IB_HCA, when what it depends on changed; record it with when and why; fail a degraded rail "
           "naming the figure, the floor and the fix.")

    def needs(self, args: Args, host: HostContext):
        if args.phase == "state":
            return {"record": QualificationRecord(), "boot": BootId(), "smi": NvidiaSmi(), "rdma": RdmaFirmware()}
        fabrics, mine = play_fabric(host)
        if not mine or len(fabrics) < 2 or _pending(host):
            return {}
        try:
            why = due(args, host, fabrics)
        except ValueError:
            return {}  # plan says which variable
        if why is None:
            return {"ib": Ibdev2netdev()}
        named = {"bw": throughput_fact(args, host, fabrics), "ib": Ibdev2netdev()}
        if args.record:
            named["record"] = QualificationRecord()
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        if args.phase == "state":
            smi, record = facts.smi, facts.record
            state: QualState = {"record": record if record.get("present") else None, "boot_id": facts.boot,
                                "driver": smi.get("driver_version") if smi.get("present") else None,
                                "firmware": firmware_summary(facts.rdma)}
            rec = state["record"]
            return Plan(msg=(f"qualified {rec.get('measured_at')} ({rec.get('reason') or 'reason not recorded'})"
                             if rec else "no qualification recorded"), exports=QUAL_STATE(state))
        h = host.name
        fabrics, mine = play_fabric(host)
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
            why = due(args, host, fabrics)
        except ValueError as e:
            return Plan.fail(f"{h}: {e}")
        named = named_hcas(host, mine)
        nccl = ib_hca_problems(named, facts.ib["devices"])
        if why is None:
            return self._standing(args, host, QUAL_STATE.read(host.exports, h)["record"], named, nccl)
        measured = facts.bw
        results = []
        for r, peer, p in rail_peers(host, fabrics):
            m = measured.get(r["iface"]) or {"error": "no measurement came back"}
            results.append(judge_rail({**m, "iface": r["iface"], "hca": r.get("hca"), "peer": peer,
                                       "peer_addr": p["address"]}, floor=floor, expected=expected, mtu=r.get("mtu") or 9000))
        inputs = inputs_of(args, host, fabrics, floor, expected)
        state = QUAL_STATE.read(host.exports, h) or {}
        doc = {"version": 1, "tool": "ib_write_bw", "seconds": args.seconds, "qps": args.qps,
               "measured_at": time.strftime(TIME_FORMAT, time.gmtime()), "floor_gbps": floor,
               "expected_gbps": expected, "rails": results, "nccl_ib_hca": ",".join(named) or None,
               "nccl_problems": nccl, "remeasure": remeasure(args, host, fabrics),
               "ok": not nccl and all(r["status"] != "degraded" for r in results),
               "measured_by": "provision", "reason": why, "key": key_of(inputs), "inputs": inputs,
               "boot_id": state.get("boot_id")}
        fails = [r["problem"] for r in results if r["status"] == "degraded"] + [f"{h}: {p}" for p in nccl]
        warns = [r["problem"] for r in results if r["status"] in ("slow", "unmeasured")]
        msg = "; ".join(f"{r['iface']} {r['gbps']:g} Gb/s to {r['peer']}" if r["gbps"] is not None
                        else f"{r['iface']} {r['status']}" for r in results) + f" (floor {floor:g}, expected {expected:g} Gb/s, ib_write_bw {args.seconds}s "
        msg += f"{args.qps} QP); MTU {', '.join(str(r['mtu']) for r in results)}; measured: {why}"
        exports = FABRIC_QUALIFICATION({"ok": doc["ok"], "rails": results})
        changes = []
        if args.record:
            have = facts.record
            # the record on the node already says this (same key, boot, verdicts and figures within
            # the tolerance) when it was written in this run (the engine's re-read after the write),
            # or when a rail that failed failed again: nothing new to record
            settled = same_record(have, doc) and (have.get("key"), have.get("boot_id"), have.get("ok")) == \
                (doc["key"], doc["boot_id"], doc["ok"])
            written_now = have.get("measured_at") != (state.get("record") or {}).get("measured_at")
            if not (settled and (written_now or why == "the last qualification did not pass")):
                text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
                before = json.dumps({k: v for k, v in have.items() if k != "present"}, indent=2, sort_keys=True) + "\n" \
                    if have.get("present") else ""
                verdict = "degraded" if not doc["ok"] else "ok"
                changes.append(Change(f"record the qualification ({verdict}) in {QUAL_PATH}; measured: {why}",
                                      record_script(text),
                                      Diff(QUAL_PATH, before, text), [facts.fact("record")], become=True,
                                      predicts=[(facts.fact("record"), {"present": True, **doc})]))
        if fails and (host.check or not changes):
            # applied changes are verified by planning again: that plan fails with the same lines
            return Plan.fail("; ".join(fails) + (f" (would record it in {QUAL_PATH})" if changes else ""),
                             warnings=warns, exports=exports)
        return Plan(changes, msg=msg, warnings=warns, exports=exports)

    def _standing(self, args: Args, host: HostContext, record: dict[str, Any], named: list[str],
                  nccl: list[str]) -> Plan:
        """Nothing the figures depend on changed: the record stands, no rail is loaded. NCCL_IB_HCA is
        a setting, checked on every run."""
        results = record.get("rails") or []
        exports = FABRIC_QUALIFICATION({"ok": bool(record.get("ok")) and not nccl, "rails": results})
        if nccl:
            return Plan.fail("; ".join(f"{host.name}: {p}" for p in nccl), exports=exports)
        figures = "; ".join(f"{r['iface']} {r['gbps']:g} Gb/s to {r.get('peer')}" if r.get("gbps") is not None
                            else f"{r['iface']} {r.get('status')}" for r in results)
        return Plan(msg=f"{figures} (qualified {record.get('measured_at')} by {record.get('measured_by') or 'provision'}: "
                        f"{record.get('reason') or 'first qualification'}; nothing it depends on changed since, not "
                        "measured again)",
                    warnings=[r["problem"] for r in results if r.get("status") in ("slow", "unmeasured")],
                    exports=exports)
