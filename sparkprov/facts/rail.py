"""Fabric qualification: what each ConnectX-7 rail carries, measured (never its reported speed),
and the pure judgements provision (modules/fabric_qualify.py), cluster-up's preflight and the
node guard make from it.

- `RailThroughput`: from this host, per rail, `ib_write_bw` (perftest, the tool NVIDIA's own
  guide measures the link with) against the peer's address on that rail: its server started on
  the peer over the mesh SSH, the client run here; and both ends' MTU. Nothing is written on
  either host: the server exits after its one test.
- `parse_ib_write_bw`, `judge_rail` (sparkprov/node/rail.py, which the node guard runs too): the
  figure from perftest's output (tested on the real GB10 captures of gb10-failure-outputs.md §4.5)
  and the verdict on one rail.
- `ib_hca_problems`, `degraded`: the verdicts on a node, on literal data.
- `QualificationRecord`: the last qualification a node recorded (QUAL_PATH), read by
  cluster-up's preflight.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.inputfiles import Stored, shape_problem
from sparkprov.inventory_vars import default
# the parser and the judgement live in the node package: the guard judges with them after a boot
from sparkprov.node.rail import (FIX, MTU_FIX, PEER_SILENT, RAIL_MTU, judge_rail, parse_ib_write_bw,  # noqa: F401
                                 parse_rail_throughput)
from sparkprov.transport.shell import cmd, quote

from sparkprov.node.requalify import QUALIFICATION_PATH as QUAL_PATH  # noqa: E402 (the guard rewrites it)

# Under EXPECTED_GBPS a rail is reported (a warning), under MIN_GBPS it fails: the inventory
# variables rail_expected_gbps and rail_min_gbps, their defaults with their sources in
# sparkprov/inventory_vars.py.
EXPECTED_GBPS = default("rail_expected_gbps")
MIN_GBPS = default("rail_min_gbps")
CLIENT_TRIES = 40   # half a second apart: the server has 20 s to start listening


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
