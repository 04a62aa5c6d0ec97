"""The fabric qualified again after a boot (pure): provision's measurement (facts/rail.py
RailThroughput) is left in the qualification record by the fabric_qualify module (its `remeasure`:
user, command, each rail's MTU); after a boot it has not seen, the guard runs that text as the login
user and judges its output with rail.py, as provision does, rewriting the record (cluster-up's
preflight reads it) and journaling each degraded rail.
"""

from __future__ import annotations

import json
import time

from .decide import event
from .rail import FIX, MTU_FIX, PEER_SILENT, RAIL_MTU, judge_rail

# The fabric qualification provision records (sparkprov/facts/rail.py QUAL_PATH): served at /metrics.
QUALIFICATION_PATH = "/var/lib/sparkprov/fabric/qualification.json"
REQUALIFY_ACTION = "reported: multi-node starts refused until it qualifies"


def parse_qualification(text: str) -> list[dict]:
    """The rails of the fabric qualification record (written by provision): iface, peer, the figure
    measured, the floor and its status ("degraded": under the floor or a wrong MTU). [] unreadable."""
    try:
        rails = json.loads(text).get("rails") or []
    except (ValueError, AttributeError):
        return []
    return [{k: r.get(k) for k in ("iface", "peer", "gbps", "floor_gbps", "status")} for r in rails
            if isinstance(r, dict) and r.get("iface")]


def boot_is_new(marker: str | None, boot_id: str) -> bool:
    """Whether the guard starts in a boot it has not seen. `marker`: what was left in /run this boot
    (None: nothing; /run is emptied at boot), holding that boot's id. The guard module leaves one
    before it (re)starts the guard (modules/guard.py same_boot_script): provision's start is not a boot."""
    return marker is None or marker.strip() != boot_id.strip()


def remeasure_spec(record: dict) -> dict | None:
    """The measurement provision left in the record for the guard, or None (no rails, or a record
    written before provision left one: the guard cannot re-measure what it was not told)."""
    spec = record.get("remeasure") if isinstance(record, dict) else None
    if not isinstance(spec, dict) or not spec.get("user") or not spec.get("command") or not record.get("rails"):
        return None
    return spec


def as_user(argv: list[str], user: tuple[str, int, int, str], euid: int) -> list[str]:
    """`argv` run as `user` (name, uid, gid, home) from a guard running as `euid`: setpriv, not runuser
    or sudo (no PAM session: nothing to configure, nothing logged per run), with the login user's
    groups and the environment a login gives those tools (ssh reads ~/.ssh of the uid anyway)."""
    name, uid, gid, home = user
    if uid == euid:
        return argv
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "env", f"HOME={home}", f"USER={name}",
            f"LOGNAME={name}", *argv]


def peer_silent(measured: dict[str, dict]) -> list[str]:
    """The rails whose peer did not answer the mesh SSH (still booting, or down): worth waiting for."""
    return sorted(i for i, m in measured.items() if m.get("gbps") is None and str(m.get("error") or "").startswith(PEER_SILENT))


def requalified_record(record: dict, measured: dict[str, dict], *, now: float, boot_id: str) -> dict:
    """The record rewritten from the guard's measurement after a boot: each rail judged as provision
    judges it (the record's floor and expected figure, the rail's MTU), `ok` again over all of them."""
    mtus = {r.get("iface"): r.get("mtu") for r in (record.get("remeasure") or {}).get("rails") or []}
    floor, expected = float(record["floor_gbps"]), float(record["expected_gbps"])
    rails = []
    for old in record.get("rails") or []:
        m = measured.get(old["iface"]) or {"error": "no measurement came back"}
        rails.append(judge_rail({**m, **{k: old.get(k) for k in ("iface", "hca", "peer", "peer_addr")}},
                                floor=floor, expected=expected, mtu=mtus.get(old["iface"]) or RAIL_MTU))
    return {**record, "rails": rails, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "measured_by": f"the node guard, after boot {boot_id}", "boot_id": boot_id,
            "reason": f"boot {boot_id}: the node guard measures after every boot",
            "ok": not record.get("nccl_problems") and all(r["status"] != "degraded" for r in rails)}


def requalify_events(record: dict, now: float, silent: list[str], waited_s: float) -> list[dict]:
    """One journal event per degraded rail of the re-measured record: the reading, the floor, what
    follows (cluster-up's preflight refuses a multi-node start over it) and the fix."""
    events = []
    for r in record.get("rails") or []:
        if r.get("status") != "degraded":
            continue
        head = f"{r['iface']} -> {r.get('peer')} {r.get('peer_addr')}: "
        if r["iface"] in silent:
            reading = head + f"the peer did not answer the mesh SSH within {waited_s:.0f}s after this boot"
            fix = f"power on or repair {r.get('peer')} and this rail's cable, then invoke provision --tags fabric"
        else:
            reading = head + (f"{r['gbps']:g} Gb/s measured (ib_write_bw)" if r.get("gbps") is not None else "nothing carried")
            mtu = [f"MTU {v}" for v in (r.get("mtu"), r.get("peer_mtu")) if v is not None and v < RAIL_MTU]
            reading += "".join(f", {x}" for x in mtu)
            fix = (MTU_FIX if mtu else FIX) + "; then invoke provision --tags fabric to qualify again"
        events.append(event(now, "rail-degraded", reading, f"floor {r['floor_gbps']:g} Gb/s, MTU {RAIL_MTU}",
                             REQUALIFY_ACTION, fix=fix, problem=r.get("problem")))
    return events
