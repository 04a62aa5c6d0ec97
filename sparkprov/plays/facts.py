"""`invoke facts`: every fact of the host profile (facts/profile.py) gathered on the hosts, as the
engine gathers a play's facts."""

from __future__ import annotations


from sparkprov.data.inventory import Inventory
from sparkprov.engine.gather import HostFacts, gather_facts
from sparkprov.facts.profile import host_profile
from sparkprov.facts.topology import discover, host_view


def read_facts(inv: Inventory, targets: list[str], *, forks: int,
               accept_new_host_keys: bool = False) -> tuple[dict[str, HostFacts], int]:
    """Per host {ok, facts, errors, ...} and the exit code: 0 when every fact was read, 4 when a host
    is unreachable, else 2."""
    profile = host_profile()
    if len(targets) < 2:
        profile.pop("neighbours")  # a topology takes two hosts' answers
    result = gather_facts(inv, targets, profile, forks=forks, accept_new_host_keys=accept_new_host_keys)
    add_topology(result, targets)
    code = (0 if all(r["ok"] for r in result.values())
            else 4 if any(r.get("unreachable") for r in result.values()) else 2)
    return result, code


def add_topology(result: dict[str, HostFacts], targets: list[str]) -> None:
    """The fabric's topology as the hosts read now (who answers on each twin, known by MAC across
    the hosts asked), as each host's `topology` section in place of the raw neighbour answers."""
    found = {}
    for h in targets:
        facts = (result.get(h) or {}).get("facts") or {}
        nb = facts.pop("neighbours", None)
        if nb is None:
            continue
        up = {r["iface"] for r in (facts.get("fabric") or {}).get("rails") or []}
        found[h] = {i: {**d, "up": d.get("oper") == "up" or i in up} for i, d in nb.items() if d.get("mac")}
    order = [h for h in targets if h in found]
    if len(order) < 2:
        return
    topo = discover(found, order)
    for h in order:
        result[h]["facts"]["topology"] = host_view(topo, h)
