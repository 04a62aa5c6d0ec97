"""`invoke bench DEPLOYMENT` on the engine: the bench play (plays/serve.py bench_book, the module
modules/serve_bench.py) runs vLLM's benchmark client in the deployment's rank 0 container; each run
it brings back is stored, plotted and compared on this machine (serving/bench.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkprov.data.inventory import Inventory
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.modules.serve_bench import BENCH, BENCH_MEMBER, BENCH_TARGET
from sparkprov.plays.book import run_book
from sparkprov.plays.serve import bench_book
from sparkprov.serving import bench as sb


class BenchResult(sb.BenchRun, total=False):
    """A run bench brought back and stored (its path), plotted, compared when asked."""
    plot: str
    compare: sb.Comparison | None
    compared: bool


@dataclass
class BenchRuns:
    served: list[str] = field(default_factory=list)           # the hosts whose rank 0 serves the deployment
    runs: list[BenchResult] = field(default_factory=list)     # each stored run, its path, plot and comparison
    skipped: list[str] = field(default_factory=list)          # stored files --compare could not read, and why


def run_bench(inv: Inventory, targets: list[str], args: dict[str, Any], options: RunOptions, report: Report, *,
              results: Path, compare: bool = False) -> BenchRuns:
    """The bench play on the targets (`args`: serve_bench's); every run stored under `results` with
    the deployment's hosts (rank 0 first) and plotted, compared with the last stored one when asked."""
    runner = run_book(inv, bench_book(targets, **args), targets, options, report)
    found = BenchRuns(served=list(BENCH_TARGET.by_host(runner.exports, targets)))
    ranks = BENCH_MEMBER.by_host(runner.exports, targets)
    members = sorted(ranks, key=lambda h: _rank(ranks[h].get("rank")))
    for h in targets:
        rec = BENCH.read(runner.exports, h)
        if not rec:
            continue
        rec = sb.with_hosts(rec, members)
        old, skipped = sb.previous(results, rec) if compare else (None, [])
        found.skipped += [e.line() for e in skipped]
        path = sb.store(results, rec)
        png = sb.plot(rec, path.with_suffix(".png"))
        stored: BenchResult = {**rec, "path": str(path), "plot": str(png),
                             "compare": sb.compare(rec, old) if old else None, "compared": bool(compare)}
        found.runs.append(stored)
    return found


def _rank(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1 << 30  # unknown ranks after the known ones
