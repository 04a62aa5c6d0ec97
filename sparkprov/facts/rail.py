"""Fabric qualification: what each ConnectX-7 rail carries, measured (never its reported speed),
and the pure judgements provision (modules/fabric_qualify.py), cluster-up's preflight and the
node guard make from it.

- `RailThroughput`: from this host, per rail, `ib_write_bw` (perftest, the tool NVIDIA's own
  guide measures the link with) against the peer's address on that rail: its server started on
  the peer over the mesh SSH, the client run here; and both ends' MTU. Nothing is written on
  either host: the server exits after its one test.
- `parse_ib_write_bw`: the figure from perftest's output (tested on the real GB10 captures of
  gb10-failure-outputs.md §4.5).
- `judge_rail`, `ib_hca_problems`, `degraded`: the verdicts, on literal data.
- `QualificationRecord`: the last qualification a node recorded (QUAL_PATH), read by
  cluster-up's preflight.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.inputfiles import Stored, shape_problem
from sparkprov.inventory_vars import default
from sparkprov.transport.shell import cmd, quote

QUAL_PATH = "/var/lib/sparkprov/fabric/qualification.json"

# Under EXPECTED_GBPS a rail is reported (a warning), under MIN_GBPS it fails: the inventory
# variables rail_expected_gbps and rail_min_gbps, their defaults with their sources in
# sparkprov/inventory_vars.py.
EXPECTED_GBPS = default("rail_expected_gbps")
MIN_GBPS = default("rail_min_gbps")
# The MTU both ends of a rail need (gb10-outputs.md: community guides raise it to 9000, NCCL
# bandwidth over the link is far lower without it; multinode-notes.md: dgx-spark-playbooks#25).
RAIL_MTU = 9000

FIX = ("reseat or replace the QSFP cable; check link speed and FEC on both ends (`ethtool IFACE`: "
       "Speed 200000Mb/s; `ethtool --show-fec IFACE`: a direct cable negotiated FEC None ran NCCL at 2.8 GB/s); "
       "check `dmesg | grep -i mlx5` for the PCIe slot power messages of NVIDIA/dgx-spark-playbooks PR#108")
MTU_FIX = "MTU 9000 on both ends of the rail (invoke provision --tags fabric on both hosts)"

CLIENT_TRIES = 40   # half a second apart: the server has 20 s to start listening

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


@dataclass(frozen=True)
class RailThroughput(Fact):
    """Per rail (iface, hca, peer address, peer iface, peer hca): this end's MTU, then ib_write_bw's
    server started on the peer over SSH (BatchMode, pinned host keys: the mesh ssh_mesh made), which
    prints the peer's MTU first, and the client run here against the peer's rail address for
    `seconds`. One rail after another, each on its own port (port + rail index). Runs as the login
    user; nothing is written on either host (the server exits after its one test)."""

    rails: tuple[tuple[str, str, str, str, str], ...]
    ssh_user: str = ""
    seconds: int = 3
    port: int = 18515     # perftest's default port
    qps: int = 1
    # per rail, the port its server listens on (default: port + the rail's index). A mesh or ring
    # gives each rail port + the peer twin's place among a Spark's four: a twin has one link, so no
    # two hosts measuring into the same peer at once ask it for the same port
    ports: tuple[int, ...] = ()

    def command(self, sh: ShellCtx) -> str:
        lines = ['__rq=$(mktemp -d)', "trap 'rm -rf \"$__rq\"' EXIT",
                 "command -v ib_write_bw >/dev/null 2>&1 && __rq_tool=1 || __rq_tool=0"]
        wait_s = self.seconds + 30   # the server waits for the client (ssh and its start) and the test
        for i, (iface, hca, addr, peer_iface, peer_hca) in enumerate(self.rails):
            port = self.ports[i] if i < len(self.ports) else self.port + i
            bw = ("-d", None, "-p", port, "-F", "--report_gbits", "-D", self.seconds, "-q", self.qps)
            remote = (f"printf 'peer_mtu=%s\\n' \"$(cat {quote('/sys/class/net/' + peer_iface + '/mtu')} 2>/dev/null)\"; "
                      "command -v ib_write_bw >/dev/null 2>&1 || { echo @no-tool; exit 0; }; "
                      + "exec " + cmd("timeout", wait_s, "ib_write_bw", *_with(bw, peer_hca)))
            server = cmd("ssh", "-n", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5",
                         f"{self.ssh_user}@{addr}", remote)
            client = cmd("timeout", self.seconds + 20, "ib_write_bw", *_with(bw, hca), addr)
            lines += [
                f"printf '@rail %s\\n' {quote(iface)}",
                f"printf 'mtu=%s\\n' \"$(cat {quote('/sys/class/net/' + iface + '/mtu')} 2>/dev/null)\"",
                "if [ $__rq_tool = 0 ]; then echo @no-tool; else",
                # the server in the background (fd 3, the gather's stdout, closed: it must not hold it)
                f"  {{ {server} > \"$__rq/s{i}\" 2>&1 3>&-; echo \"@rc=$?\" >> \"$__rq/s{i}\"; }} & __rq_s=$!",
                # the client until the server listens (ssh and its start take a moment; on a loaded
                # host several seconds), or the server has ended (it could not start: its output says why)
                f"  __rq_r=1; for __t in {' '.join(map(str, range(CLIENT_TRIES)))}; do sleep 0.5; "
                f"__rq_c=$({client} 2>&1); __rq_r=$?; [ $__rq_r = 0 ] && break; "
                f"grep -q '^@rc=' \"$__rq/s{i}\" 2>/dev/null && break; done",
                "  wait $__rq_s",
                f"  echo @server; cat \"$__rq/s{i}\"; echo @client; printf '%s\\n' \"$__rq_c\"; echo \"@crc=$__rq_r\"",
                "fi",
            ]
        return "\n".join(lines)

    def parse(self, out: str, err: str, rc: int) -> dict[str, dict[str, Any]]:
        return parse_rail_throughput(out)


def _with(bw: tuple, hca: str) -> tuple:
    return tuple(hca if a is None else a for a in bw)


def parse_rail_throughput(out: str) -> dict[str, dict[str, Any]]:
    """iface -> {mtu, peer_mtu, gbps, error, tool} from RailThroughput's output."""
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
                why = f"the server on the peer did not start: {srv[-1].strip()}"
            res["error"] = why
        rails[iface] = res
    return rails


@dataclass(frozen=True)
class QualificationRecord(Fact):
    """The node's last fabric qualification (QUAL_PATH, written by provision): {"present": False}
    when there is none."""

    path: str = QUAL_PATH

    def command(self, sh: ShellCtx) -> str:
        # bounded: a record of a Spark's four rails is about 2 KiB
        return f"if [ -f {sh.path(self.path)} ]; then head -c {RECORD_BYTES} {sh.path(self.path)}; else echo @absent; fi"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_record(out)


RECORD_BYTES = 1 * 2**20


# The record as fabric_qualify writes it, read back (the figures judged and printed are numbers).
class RecordedRail(Stored):
    iface: str | None = None
    hca: str | None = None
    peer: str | None = None
    status: str | None = None
    gbps: float | None = None
    floor_gbps: float | None = None
    mtu: int | None = None
    peer_mtu: int | None = None


class Record(Stored):
    measured_at: str | None = None
    rails: list[RecordedRail] = []
    nccl_problems: list[str] = []


def parse_record(out: str) -> dict[str, Any]:
    if out.strip() == "@absent":
        return {"present": False}
    fix = (f"(fix: remove it, sudo rm {QUAL_PATH}; invoke provision --tags fabric measures the rails and "
           "writes it again)")
    try:
        doc = json.loads(out)
    except (ValueError, RecursionError) as exc:
        raise FactError(f"{QUAL_PATH} is not JSON: {str(exc)[:100]} {fix}") from None
    try:
        Record.model_validate(doc)
    except ValidationError as exc:
        raise FactError(f"{QUAL_PATH} is not a qualification record: {shape_problem(exc)} {fix}") from None
    return {"present": True, **doc}


# -- the judgements -------------------------------------------------------------------------------

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


_HCA_RE = re.compile(r"^(?P<kind>[a-z]+)(?:P(?P<domain>\d+))?p(?P<bus>\d+)s(?P<slot>\d+)f(?P<fn>\d+)$")


def port_of(hca: str) -> tuple[str, str, str, str] | None:
    """The QSFP port an RDMA device is half of: a GB10's ConnectX-7 shows each port twice, once per
    PCIe domain (gb10-outputs.md, ibdev2netdev with one cable in port 1: rocep1s0f1 and roceP2p1s0f1
    Up, the f0 twins Down). None for a name of another form."""
    m = _HCA_RE.match(hca)
    return (m["kind"], m["bus"], m["slot"], m["fn"]) if m else None


def ib_hca_problems(named: list[str], devices: list[dict[str, Any]]) -> list[str]:
    """NCCL_IB_HCA must name both halves of a port: with one of a port's two HCAs NCCL runs at half
    speed (NVIDIA/dgx-spark-playbooks#102; multinode-notes.md). `devices`: ibdev2netdev's. One line
    per cabled port (both halves Up) that `named` names only half of."""
    halves: dict[tuple, list[str]] = {}
    for d in devices:
        key = port_of(d["hca"])
        if key and d.get("up"):
            halves.setdefault(key, []).append(d["hca"])
    out = []
    for hcas in halves.values():
        named_here = [h for h in hcas if h in named]
        if len(hcas) > 1 and named_here and len(named_here) < len(hcas):
            missing = [h for h in hcas if h not in named]
            out.append(f"NCCL_IB_HCA={','.join(named)} names {', '.join(named_here)} but not {', '.join(missing)}, "
                       "the other half of the same QSFP port: NCCL uses half the port (#102: about 3 GB/s all-gather "
                       f"against 23) (fix: name both, ib_hcas: [{', '.join(sorted(hcas))}] in the inventory, or "
                       "remove ib_hcas to use every provisioned rail)")
    return out


def degraded(host: str, record: dict[str, Any]) -> list[str]:
    """What a node's last qualification says stands against a multi-node start over it: one line per
    degraded rail (host, rail, measured, floor) and the NCCL_IB_HCA problems. [] when there is no
    record (never qualified: nothing is known against it)."""
    if not record or not record.get("present", True):
        return []
    when = record.get("measured_at") or "?"
    out = []
    for r in record.get("rails") or []:
        if r.get("status") == "degraded":
            fig = f"{r['gbps']:g} Gb/s measured" if r.get("gbps") is not None else "nothing carried"
            mtu = [f"MTU {v}" for v in (r.get("mtu"), r.get("peer_mtu")) if v is not None and v < RAIL_MTU]
            out.append(f"{host}: rail {r.get('iface')} to {r.get('peer')} was degraded at its last qualification "
                       f"({when}): {', '.join([fig] + mtu)}, floor {r.get('floor_gbps'):g} Gb/s (fix: "
                       f"{MTU_FIX if mtu else FIX}; then invoke provision --hosts {host} --tags fabric to qualify again)")
    out += [f"{host}: {p}" for p in record.get("nccl_problems") or []]
    return out
