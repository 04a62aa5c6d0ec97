"""`invoke images --host H`: one play (image_flags) on the host: the digest each catalog image's tag
resolved to there and, with --flags, each present image's own options cached on this machine."""

from __future__ import annotations

import io
from dataclasses import dataclass

from sparkprov.data.inventory import Inventory
from sparkprov.data.playbook import Playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.modules.image_flags import IMAGE_FLAGS
from sparkprov.plays.book import play, run_book, task


@dataclass
class HostImages:
    host: str
    digests: dict[str, str]  # image reference -> the digest it has on the host
    lines: list[str]         # what failed there (and with flags what was asked), one line each
    code: int                # the run's exit code


def host_images(inv: Inventory, host: str, versions: dict[str, str | None], *, ask: bool) -> HostImages:
    """`versions`: image reference -> the vLLM version the catalog says it ships."""
    name = host if host in inv.hosts else inv.resolve(host, what="--host")[0]
    refs = list(versions)
    book = Playbook("images", [play("images", [name], [task(
        "image digests and options", "image_flags", {"images": refs, "ask": ask, "versions": versions},
        ("--host", None, None))])])
    report = Report(io.StringIO(), quiet=True)
    runner = run_book(inv, book, [name], RunOptions(), report)
    lines = [f"{name}: {r.msg}" for r in report.results
             if r.status in ("failed", "unreachable") or (r.status == "changed" and ask)]
    return HostImages(name, dict((IMAGE_FLAGS.read(runner.exports, name) or {}).get("digests") or {}), lines,
                      report.exit_code())
