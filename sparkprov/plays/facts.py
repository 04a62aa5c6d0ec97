"""`invoke facts`: every fact of the host profile (facts/profile.py) gathered on the hosts, as the
engine gathers a play's facts."""

from __future__ import annotations

from sparkprov.data.inventory import Inventory
from sparkprov.engine.gather import HostFacts, gather_facts
from sparkprov.facts.profile import host_profile


def read_facts(inv: Inventory, targets: list[str], *, forks: int,
               accept_new_host_keys: bool = False) -> tuple[dict[str, HostFacts], int]:
    """Per host {ok, facts, errors, ...} and the exit code: 0 when every fact was read, 4 when a host
    is unreachable, else 2."""
    result = gather_facts(inv, targets, host_profile(), forks=forks, accept_new_host_keys=accept_new_host_keys)
    code = (0 if all(r["ok"] for r in result.values())
            else 4 if any(r.get("unreachable") for r in result.values()) else 2)
    return result, code
