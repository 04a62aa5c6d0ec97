"""Shared helpers of the engine benchmarks: the lab, sshd log counting, machine facts, the
README section writer. Runs as root with the project's venv (it drives the lab)."""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULTS = BENCH / "results"
RUN_DIR = BENCH / ".run"          # generated inventories/configs (gitignored)
BENCH_VENV = BENCH / ".venv"      # ansible-core + pyinfra, never the project's .venv
PINS = ("ansible-core==2.19.14", "pyinfra==3.10.0")

sys.path.insert(0, str(REPO))


# -- the lab -----------------------------------------------------------------------------
def lab_up(n: int) -> dict[str, str]:
    """A lab of exactly n light hosts (no dockerd): name -> address. Rebuilds the lab when it
    has another host count (that tears down whatever lab was up)."""
    from sparklab import up

    res = up.up(n, light=True, images=False, quiet=True)
    return dict(sorted(res.hosts.items(), key=lambda kv: int(kv[0].removeprefix("spark"))))


def lab_down() -> None:
    from sparklab import up

    up.down(quiet=True)


def lab_paths() -> dict[str, Path]:
    from sparklab import state

    return {"key": state.key_path(), "known_hosts": state.known_hosts_path(),
            "password": state.password_path(), "inventory": state.inventory_path()}


def in_hosts(names: list[str], script: str) -> list[subprocess.CompletedProcess]:
    """Run a root shell script inside each lab host (nsenter; not through sshd, so it never
    shows in the counts), in parallel."""
    from sparklab.hosts import nsexec

    with ThreadPoolExecutor(max_workers=min(8, len(names))) as ex:
        return list(ex.map(lambda n: nsexec(n, ["sh", "-c", script], check=False), names))


# -- the lab benches' command line, timed plays and results ---------------------------------
def lab_bench_args(doc: str | None, name: str):
    """The options of a bench that brings up its own lab: --runs, --json (results under
    bench/results/NAME-DATE.json), --keep (leave the lab up)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true", help=f"write bench/results/{name}-DATE.json")
    ap.add_argument("--keep", action="store_true", help="leave the lab up")
    return ap.parse_args()


def write_result(name: str, out: dict) -> Path:
    """`out` as bench/results/NAME-DATE.json (its "date")."""
    import json

    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}-{out['date']}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    return path


def stamped_report():
    """A quiet engine Report that also keeps each play's start and each host's result, as lines of
    seconds from its creation (`events`; `t0` the start): where a play's time goes."""
    import io
    import time

    from sparkprov.engine.report import Report

    class Stamped(Report):
        def __init__(self):
            super().__init__(io.StringIO(), quiet=True)
            self.t0 = time.monotonic()
            self.events: list[str] = []

        def play(self, name, hosts):
            self.events.append(f"{time.monotonic() - self.t0:6.2f} play {name}")
            super().play(name, hosts)

        def record(self, result):
            self.events.append(f"{time.monotonic() - self.t0:6.2f}   {result.host} {result.status}: {result.task}")
            super().record(result)

    return Stamped()


# -- counting remote executions from sshd's logs --------------------------------------------
SESSION = re.compile(r"Starting session: (command|forced-command|shell|subsystem '([^']+)')")
ACCEPTED = re.compile(r"Accepted publickey for ")


class SshdLogs:
    """Byte offsets into each host's sshd log (LogLevel VERBOSE, sparklab/sshd.py); the
    lines written after `mark()` are what one run cost."""

    def __init__(self, names: list[str]):
        from sparklab import sshd

        self.paths = {n: sshd.log_path(n) for n in names}
        self.offsets: dict[str, int] = {}

    def mark(self) -> None:
        self.offsets = {n: (p.stat().st_size if p.exists() else 0) for n, p in self.paths.items()}

    def counts(self) -> dict[str, dict[str, int]]:
        out = {}
        for n, p in self.paths.items():
            with open(p, "rb") as fh:
                fh.seek(self.offsets.get(n, 0))
                text = fh.read().decode(errors="replace")
            c = {"connections": 0, "exec": 0, "sftp": 0, "shell": 0, "sessions": 0}
            for line in text.splitlines():
                if ACCEPTED.search(line):
                    c["connections"] += 1
                m = SESSION.search(line)
                if m:
                    kind = m.group(1)
                    c["sessions"] += 1
                    if kind in ("command", "forced-command"):
                        c["exec"] += 1
                    elif kind == "shell":
                        c["shell"] += 1
                    else:
                        c["sftp"] += 1
            out[n] = c
        return out


def verbose_sshd(names: list[str]) -> None:
    from sparklab import sshd

    for n in names:
        cfg = sshd.nsexec(n, ["cat", sshd.SSHD_CONFIG]).stdout
        if "LogLevel VERBOSE" not in cfg:
            raise SystemExit(f"{n}: sshd is not at LogLevel VERBOSE; run `invoke lab.up` with this checkout")


# -- machine and versions ------------------------------------------------------------------
def _out(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return (r.stdout or r.stderr).strip()
    except OSError:
        return ""


def machine() -> dict[str, str]:
    mem_kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    debian = Path("/etc/debian_version").read_text().strip() if Path("/etc/debian_version").exists() else "?"
    return {"cpus": str(os.cpu_count()), "cpu": cpu, "memory_gib": f"{mem_kib / 1024 / 1024:.1f}",
            "os": f"Debian {debian}", "kernel": platform.release(),
            "openssh": _out(["ssh", "-V"]).split(",")[0]}


def pip_version(python: Path, dist: str) -> str:
    return _out([str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- the README ----------------------------------------------------------------------------
def write_section(name: str, text: str) -> None:
    """Replace (or append) the README section between <!-- NAME:begin --> and <!-- NAME:end -->,
    leaving every other section (other benchmarks' included) as it is."""
    readme = BENCH / "README.md"
    cur = readme.read_text() if readme.exists() else "# Benchmarks\n"
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in cur and end in cur:
        pre, rest = cur.split(begin, 1)
        post = rest.split(end, 1)[1]
        new = pre + block + post
    else:
        new = cur.rstrip("\n") + "\n\n" + block + "\n"
    readme.write_text(new)
