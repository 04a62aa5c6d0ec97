"""Proving from the outside that serving internals let no one in (issue 27), for the lab tests that
hold a multi-node deployment: the Ray TP 2 one of test_cluster.py and the pinned native TP 2 one of
test_real_tp2.py.

Every TCP socket a member host listens on, read with `ss` in the host itself (not the sockets
`status --ports` attributes to the deployment: a socket it misses must be probed all the same), is
probed from the management network (the root namespace on the lab bridge: where a laptop on a Spark
owner's LAN would be) and from a stranger on the fabric (spark3 when the lab has one; in the two-host
lab, an extra address on spark2's rail that no member has); the other member still reaches every
internal port over the fabric. Only sshd and the deployment's keyed API port answer everyone."""

from __future__ import annotations

import json
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
INVOKE = str(REPO_ROOT / ".venv" / "bin" / "invoke")
MEMBERS = ["spark1", "spark2"]
FABRIC = {"spark1": "192.168.100.11", "spark2": "192.168.100.12"}  # rail 0 as provision addresses it
STRANGER_IP = "192.168.100.99"  # two-host lab: an address on spark2's rail that no member has
RAIL = "enp1s0f1np1"
OPEN_TO_EVERYONE = {22}  # sshd; the deployment's API port is added per deployment


def cli(inv, task, *args, timeout=900):
    p = subprocess.run([INVOKE, task, "--inventory", str(inv), *args, "--json"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=timeout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {}
    return p.returncode, doc, p.stderr[-3000:] + p.stdout[-3000:]


@contextmanager
def stranger(lab):
    """Where a stranger on the fabric probes from: (host, source address or None)."""
    if "spark3" in lab.hosts:
        yield ("spark3", None)
        return
    lab.sh("spark2", f"ip addr add {STRANGER_IP}/24 dev {RAIL}")
    try:
        yield ("spark2", STRANGER_IP)
    finally:
        lab.sh("spark2", f"ip addr del {STRANGER_IP}/24 dev {RAIL}")


def listening(lab, host: str) -> list[tuple[str, int]]:
    """Every TCP socket the host listens on, but on loopback: (address, port), from `ss` in the host."""
    out = lab.sh(host, "ss -H -tln").stdout
    found = set()
    for line in out.splitlines():
        w = line.split()
        if len(w) < 4:
            continue
        addr, _, port = w[3].rpartition(":")
        addr = addr.split("%")[0].strip("[]")
        if addr.startswith("127.") or addr == "::1":
            continue
        found.add((addr, int(port)))
    return sorted(found)


PROBE = ("import socket, sys, json\nfrom concurrent.futures import ThreadPoolExecutor\n"
         "src, targets = sys.argv[1] or None, json.loads(sys.argv[2])\n"
         "def go(t):\n  s = socket.socket(); s.settimeout(0.7)\n"
         "  try:\n    src and s.bind((src, 0)); s.connect((t[0], t[1])); return True\n"
         "  except OSError:\n    return False\n  finally:\n    s.close()\n"
         "print(json.dumps(list(ThreadPoolExecutor(32).map(go, targets))))")


def reachable_from(lab, where, source, targets) -> list[bool]:
    """For each (address, port): whether a TCP connection from `where` succeeds (None: the root
    namespace, the lab's management network), bound to `source` when given."""
    if where is None:
        def go(t):
            try:
                socket.create_connection(t, timeout=0.7).close()
                return True
            except OSError:
                return False
        return list(ThreadPoolExecutor(32).map(go, targets))
    out = lab.exec(where, ["python3", "-c", PROBE, source or "", json.dumps(targets)], check=True).stdout
    return json.loads(out)


def ports_report(inv, api_port: int) -> dict:
    """`status --ports` with no stranger on the fabric: exit 0 (nothing open to everyone but sshd and
    the keyed API port), the API port reported as keyed and owned by the deployment; the document."""
    rc, doc, out = cli(inv, "status", "--ports")
    assert rc == 0, out
    for host in MEMBERS:
        rows = doc["hosts"][host]["ports"]
        assert not [r for r in rows if r["flag"]], rows
        everyone = {r["port"] for r in rows if r["reach"] == "everyone"}
        assert everyone <= OPEN_TO_EVERYONE | {api_port}, rows
    api = [r for r in doc["hosts"]["spark1"]["ports"] if r["port"] == api_port]
    assert api and "keyed" in api[0]["why"] and api[0]["deployment"], api
    return doc


def assert_locked(lab, inv, deployment: str, api_port: int) -> None:
    """Every TCP socket of every member outside loopback, as `ss` in the host lists it: reported by
    `status --ports` (none missed), and reachable as the report says. From the management network
    (through the host's LAN address: a LAN cannot route to the fabric) only what it calls open to
    everyone answers (sshd and the keyed API port); what its firewall closes to all but the members
    answers neither the management network nor the stranger on the fabric, and answers the other
    member over the fabric. In a two-host lab the stranger is an extra rail address of spark2: to
    spark2's own ports that is local traffic (it never crosses the fabric), so it probes spark1's."""
    doc = ports_report(inv, api_port)
    with stranger(lab) as (where, source):
        for host in MEMBERS:
            rows = {(r["address"], r["port"]): r for r in doc["hosts"][host]["ports"] if r["proto"] == "tcp"}
            # the node guard listens on every address of a fabric interface, read again each minute:
            # it may bind the stranger's address, which this test added after the report was taken
            sockets = [s for s in listening(lab, host) if s[0] != source]
            missed = [s for s in sockets if s not in rows]
            assert not missed, f"{host}: status --ports misses {missed} of {sorted(rows)}"
            row = {s: rows[s] for s in sockets}
            ports = sorted({p for _, p in sockets})
            everyone = {s[1] for s, r in row.items() if r["reach"] == "everyone"}
            assert everyone <= OPEN_TO_EVERYONE | {api_port}, (host, everyone)
            got = reachable_from(lab, None, None, [(lab.hosts[host], p) for p in ports])
            assert {p for p, ok in zip(ports, got) if ok} == everyone, (host, dict(zip(ports, got)), everyone)
            closed = sorted({s[1] for s, r in row.items() if r["why"].startswith("closed to all but")})
            mine = sorted({s[1] for s, r in row.items() if r["deployment"] == deployment} - {api_port})
            assert mine and set(mine) <= set(closed), (host, deployment, mine, closed)
            if where != host:
                got = reachable_from(lab, where, source, [(FABRIC[host], p) for p in closed])
                assert not any(got), (host, [p for p, ok in zip(closed, got) if ok], (where, source))
            peer = next(h for h in MEMBERS if h != host)
            got = reachable_from(lab, peer, FABRIC[peer], [(FABRIC[host], p) for p in mine])
            assert all(got), ("a member is refused", host, [p for p, ok in zip(mine, got) if not ok])


def assert_no_rule_left(lab) -> None:
    for host in MEMBERS:
        rules = lab.sh(host, "nft list ruleset").stdout
        files = lab.sh(host, "ls /etc/sparkprov/nftables").stdout
        assert "sparkprov" not in rules and files.strip() == "", (host, rules, files)
