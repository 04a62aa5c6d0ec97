"""The fabric rail's measurement read and judged: perftest's ib_write_bw output, the per-rail output
of facts/rail.py's RailThroughput, and the verdict on one rail. Provision (modules/fabric_qualify.py),
cluster-up's preflight and the node guard after a boot (requalify.py) all judge with these.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

# The MTU both ends of a rail need (gb10-outputs.md: community guides raise it to 9000, NCCL
# bandwidth over the link is far lower without it; multinode-notes.md: dgx-spark-playbooks#25).
RAIL_MTU = 9000

FIX = ("reseat or replace the QSFP cable; check link speed and FEC on both ends (`ethtool IFACE`: "
       "Speed 200000Mb/s; `ethtool --show-fec IFACE`: a direct cable negotiated FEC None ran NCCL at 2.8 GB/s); "
       "check `dmesg | grep -i mlx5` for the PCIe slot power messages of NVIDIA/dgx-spark-playbooks PR#108")
MTU_FIX = "MTU 9000 on both ends of the rail (invoke provision --tags fabric on both hosts)"
# What a rail's error starts with when ib_write_bw's server could not be started on the peer over
# the mesh SSH (the peer still booting, or down).
PEER_SILENT = "the server on the peer did not start"

_ROW_RE = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)\s*$")


def parse_ib_write_bw(text: str) -> dict[str, Any]:
    """perftest's ib_write_bw output: the device, QPs and the result rows under the `#bytes`
    header (one row per message size, or one per second with --run_infinitely). `gbps` is the
    median of the rows' BW average (None when no row came: the test did not run); `error` the
    first line that says why."""
    device = re.search(r"Device\s*:\s*(\S+)", text)
    qps = re.search(r"Number of qps\s*:\s*(\d+)", text)
    rows = []
    in_table = False
    for line in text.splitlines():
        if line.lstrip().startswith("#bytes"):
            in_table = True
            continue
        m = _ROW_RE.match(line) if in_table else None
        if m:
            rows.append({"bytes": int(m.group(1)), "iterations": int(m.group(2)), "peak_gbps": float(m.group(3)),
                         "avg_gbps": float(m.group(4)), "mpps": float(m.group(5))})
    error = None
    if not rows:
        error = next((ln.strip() for ln in text.splitlines()
                      if re.search(r"couldn'?t|unable|error|fail|refused|timed? ?out|no route|not found", ln, re.I)),
                     None) or (text.strip().splitlines() or ["no output"])[-1].strip()
    return {"device": device.group(1) if device else None, "qps": int(qps.group(1)) if qps else None,
            "rows": rows, "gbps": statistics.median(r["avg_gbps"] for r in rows) if rows else None, "error": error}


def parse_rail_throughput(out: str) -> dict[str, dict[str, Any]]:
    """iface -> {mtu, peer_mtu, gbps, error, tool, output} from RailThroughput's output."""
    rails: dict[str, dict[str, Any]] = {}
    for block in re.split(r"(?m)^(?=@rail )", out):
        head, _, body = block.partition("\n")
        if not head.startswith("@rail "):
            continue
        iface = head.split(None, 1)[1].strip()
        mtu = re.search(r"(?m)^mtu=(\d*)$", body)
        res: dict[str, Any] = {"mtu": int(mtu.group(1)) if mtu and mtu.group(1) else None, "peer_mtu": None,
                               "gbps": None, "error": None, "tool": True, "output": ""}
        if re.search(r"(?m)^@no-tool$", body.partition("@client")[0]):
            where = "here" if "@server" not in body else "on the peer"
            res.update(tool=False, error=f"ib_write_bw (perftest) is not installed {where}")
            rails[iface] = res
            continue
        server, _, client = body.partition("\n@client\n")
        pm = re.search(r"(?m)^peer_mtu=(\d*)$", server)
        res["peer_mtu"] = int(pm.group(1)) if pm and pm.group(1) else None
        crc = re.search(r"(?m)^@crc=(\d+)$", client)
        client = re.sub(r"(?m)^@crc=\d+$", "", client)
        bw = parse_ib_write_bw(client)
        res["output"] = "\n".join(client.strip().splitlines()[-3:])
        if bw["gbps"] is not None and crc and crc.group(1) == "0":
            res["gbps"] = round(bw["gbps"], 2)
        else:
            srv = [ln for ln in server.splitlines() if ln.strip() and not ln.startswith(("@", "peer_mtu="))]
            why = bw["error"] or "no result"
            if srv and (not pm or re.search(r"(?i)denied|host key|refused|timed out|resolve", "\n".join(srv))):
                why = f"{PEER_SILENT}: {srv[-1].strip()}"
            res["error"] = why
        rails[iface] = res
    return rails


def judge_rail(m: dict[str, Any], *, floor: float, expected: float, mtu: int = RAIL_MTU) -> dict[str, Any]:
    """One rail's measurement judged: status "ok", "slow" (under the expected figure: a warning),
    "degraded" (under the floor, no figure, or an MTU under `mtu` on either end: a failure) or
    "unmeasured" (no ib_write_bw on an end, no RoCE device: a warning). `problem` says which,
    naming the rail, the figure, the threshold and the fix."""
    where = f"{m['iface']} ({m.get('hca') or 'no RoCE device'}) -> {m.get('peer')} {m.get('peer_addr')}"
    out = {**{k: m.get(k) for k in ("iface", "hca", "peer", "peer_addr", "gbps", "mtu", "peer_mtu")},
           "floor_gbps": floor, "expected_gbps": expected, "status": "ok", "problem": None}
    bad_mtu = [f"{who} {v}" for who, v in (("here", m.get("mtu")), (m.get("peer"), m.get("peer_mtu")))
               if v is not None and v < mtu]
    if m.get("tool") is False or not m.get("hca"):
        why = m.get("error") or "no RoCE device on this rail"
        out.update(status="unmeasured", problem=f"{where}: not measured: {why} (fix: apt install perftest on both "
                                                 "hosts, then invoke provision --tags fabric)")
    elif m.get("gbps") is None:
        out.update(status="degraded", problem=f"{where}: carried nothing: {m.get('error')} (floor {floor:g} Gb/s; "
                                               f"fix: {FIX})")
    elif m["gbps"] < floor:
        out.update(status="degraded", problem=f"{where}: {m['gbps']:g} Gb/s measured (ib_write_bw), under the floor "
                                               f"{floor:g} Gb/s (fix: {FIX})")
    elif m["gbps"] < expected:
        out.update(status="slow", problem=f"{where}: {m['gbps']:g} Gb/s measured (ib_write_bw), under the "
                                           f"{expected:g} Gb/s a healthy rail carries (fix: {FIX})")
    if bad_mtu and out["status"] != "degraded":
        out.update(status="degraded", problem=f"{where}: MTU {', '.join(bad_mtu)}, not {mtu} (fix: {MTU_FIX})")
    elif bad_mtu:
        out["problem"] += f"; MTU {', '.join(bad_mtu)}, not {mtu} (fix: {MTU_FIX})"
    return out
