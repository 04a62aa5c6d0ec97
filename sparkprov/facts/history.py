"""Facts a deployment's history reads: the history file on rank 0, and what each node runs for the
deployment (its containers and their images' registry digests, as that node's docker reports them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.transport.shell import quote

MAX_LINES = 500
# The newest bytes of the file only (a record is about 2 KiB): a file grown by hand, or /dev/zero
# linked in its place, never comes back whole. A line cut at the front is no record (skipped).
MAX_BYTES = 2 * 2**20


def _present_or_absent(out: str, err: str, what: str) -> dict[str, Any]:
    """A file read by a command that prints @present then its text, or @absent."""
    head, _, rest = out.partition("\n")
    if head.strip() not in ("@present", "@absent"):
        raise FactError(f"{what} unreadable: {(err.strip() or out.strip())[:200]}")
    return {"exists": head.strip() == "@present", "text": rest}


@dataclass(frozen=True)
class HistoryFile(Fact):
    """The newest lines of a deployment's history file ("" when there is none)."""

    path: str

    def command(self, sh: ShellCtx) -> str:
        return (f"f={sh.path(self.path)}\nif [ -f \"$f\" ]; then echo @present; tail -c {MAX_BYTES} \"$f\" | "
                f"tail -n {MAX_LINES}; else echo @absent; fi")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return _present_or_absent(out, err, "history file")


ON_DEMAND_LINES = 500  # the newest on-demand lines of the guard's journal


@dataclass(frozen=True)
class OnDemandJournal(Fact):
    """The guard's journal lines of on-demand starts and stops (node/guard.py on_demand journals
    each as `on-demand-start` or `on-demand-stop`), the newest ON_DEMAND_LINES ("" without a journal)."""

    path: str

    def command(self, sh: ShellCtx) -> str:
        f = quote(self.path)
        return (f"if [ -r {f} ]; then echo @present; tail -c {MAX_BYTES * 8} {f} | grep -F '\"on-demand-' "
                f"| tail -n {ON_DEMAND_LINES}; else echo @absent; fi")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return _present_or_absent(out, err, "guard journal")


_FORMAT = ("{{.Name}}\t{{.Id}}\t{{.Image}}\t{{.Config.Image}}\t{{.State.Status}}\t"
           '{{index .Config.Labels "sparkprov.recipe_hash"}}')


@dataclass(frozen=True)
class DeploymentImages(Fact):
    """The deployment's containers on this host (name, ID, image ID and reference, state, recipe
    hash), and each of their images' RepoDigests."""

    deployment: str

    def command(self, sh: ShellCtx) -> str:
        label = quote(f"label=sparkprov.deployment={self.deployment}")
        return ("command -v docker >/dev/null 2>&1 || exit 0\n"
                f"for c in $(docker ps -aq --filter {label}); do\n"
                f"  l=$(docker inspect --format {quote(_FORMAT)} \"$c\") || continue\n"
                "  printf 'c\\t%s\\n' \"$l\"\n"
                "  i=$(printf '%s' \"$l\" | cut -f3)\n"
                "  printf 'd\\t%s\\t%s\\n' \"$i\" \"$(docker image inspect --format '{{json .RepoDigests}}' \"$i\" "
                "2>/dev/null || echo '[]')\"\n"
                "done")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        if rc != 0:
            raise FactError(err.strip() or f"docker inspect failed (rc={rc})")
        containers, digests = [], {}
        for line in out.splitlines():
            parts = line.split("\t")
            if parts[0] == "c" and len(parts) == 7:
                name, cid, image_id, image, status, recipe_hash = parts[1:]
                containers.append({"name": name.lstrip("/"), "id": cid, "image_id": image_id, "image": image,
                                   "status": status,
                                   "recipe_hash": None if recipe_hash in ("", "<no value>") else recipe_hash})
            elif parts[0] == "d" and len(parts) == 3:
                try:
                    found = json.loads(parts[2])
                except ValueError:
                    found = []
                digests[parts[1]] = [d for d in found or [] if isinstance(d, str)]
        return {"containers": containers, "digests": digests}
