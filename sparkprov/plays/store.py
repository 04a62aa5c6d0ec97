"""`invoke store` as a play on the engine (the module is sparkprov/modules/store.py):

    store   every host   read the store and sparkprov's containers; list, or prune what no
                         deployment uses (check mode: say what would go), re-read to verify

One remote call per host to list; a prune adds the apply and the re-read.
"""

from __future__ import annotations

from typing import Any

from sparkprov.data.inventory import Inventory
from sparkprov.engine.playbook import Playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import DEFAULT_FORKS, RunOptions
from sparkprov.modules.store import STORE_CONTENTS, StoreListing
from sparkprov.plays.book import play, run_book, task


def store_args(*, prune: list[str], prune_unused: bool = False, compile_cache: bool = False,
               verify: list[str] | None = None) -> dict[str, Any]:
    """The store task's arguments: verify these repos ([]: every repo), else prune (what is named,
    what no deployment uses, the compile cache), else list."""
    if verify is not None:
        return {"action": "verify", "verify": verify}
    pruning = bool(prune or prune_unused or compile_cache)
    return {"action": "prune" if pruning else "list", "prune": prune, "unused": bool(prune_unused),
            "compile_cache": bool(compile_cache)}


def store_book(hosts: list[str], args: dict[str, Any]) -> Playbook:
    """List first (its export stands for a host whose prune is refused), then prune when asked: both
    read the same facts, gathered once."""
    where = ("store", None, None)
    tasks = [task("store: list", "store", {"action": "list", "recipe_files": args.get("recipe_files") or []}, where)]
    if args.get("action") in ("prune", "verify"):
        tasks.append(task(f"store: {args['action']}", "store", args, where))
    plays = [play("store", hosts, tasks)]
    if args.get("action") == "verify":  # what the hashing left (it is not re-planned: it would hash again)
        plays.append(play("store: after", hosts, [task("store: list", "store", tasks[0].args, where)]))
    return Playbook("store", plays)


def run_store(inventory: Inventory, hosts: list[str], args: dict[str, Any], report: Report, *, check: bool = False,
              forks: int = DEFAULT_FORKS, accept_new_host_keys: bool = False) -> dict[str, StoreListing]:
    """The store play; per host what its store holds (after a prune: what is left)."""
    runner = run_book(inventory, store_book(hosts, args), hosts,
                      RunOptions(check=check, forks=forks, accept_new_host_keys=accept_new_host_keys), report)
    return {h: STORE_CONTENTS.read(runner.exports, h) or {} for h in hosts}
