"""Gather facts from hosts without running a playbook (`invoke facts`): one call per host."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sparkprov.data.inventory import Inventory
from sparkprov.engine.facts import Fact, ShellCtx, build_gather, parse_gather
from sparkprov.engine.run import make_transport
from sparkprov.errors import SparkprovError


def gather_facts(inventory: Inventory, hosts: list[str], facts: dict[str, Fact], *, forks: int = 32,
                 accept_new_host_keys: bool = False) -> dict[str, dict[str, Any]]:
    """host -> {"ok": bool, "facts": {section: value}, "errors": {section: msg}, "remote_calls": n}"""

    def one(name: str) -> tuple[str, dict[str, Any]]:
        transport = make_transport(inventory.hosts[name], accept_new_host_keys)
        try:
            transport.connect()
            gs = build_gather(list(facts.values()), ShellCtx(None), become=False, password=None, probe_become=False)
            res = transport.run_script(gs.script)
            parsed = parse_gather(gs, res.stdout)
            out = {section: parsed.values[f.key] for section, f in facts.items() if f.key in parsed.values}
            errs = {section: parsed.errors[f.key] for section, f in facts.items() if f.key in parsed.errors}
            return name, {"ok": not errs, "facts": out, "errors": errs, "remote_calls": transport.remote_calls}
        except SparkprovError as exc:
            return name, {"ok": False, "unreachable": True, "facts": {}, "errors": {"connect": exc.line()},
                          "remote_calls": transport.remote_calls}
        finally:
            transport.close()

    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(hosts)))) as pool:
        return dict(pool.map(one, hosts))
