"""The fleet as the status play reads it, for the commands that act on every deployment at once
(gateway, monitor): a host whose containers could not be read is refused, never taken as a host
without deployments."""

from __future__ import annotations

from sparkprov.data.inventory import Inventory
from sparkprov.engine.run import RunOptions
from sparkprov.errors import SparkprovError
from sparkprov.plays.serve import HostStatus, read_status


def read_fleet(inv: Inventory, hosts: list[str], options: RunOptions, *, consequence: str) -> dict[str, HostStatus]:
    """The status play on `hosts` (status per host, as plays/serve.py read_status returns it),
    every host's containers read (refuse_unknown)."""
    st, _ = read_status(inv, hosts, options)
    refuse_unknown(st, consequence=consequence)
    return st


def refuse_unknown(st: dict[str, HostStatus], *, consequence: str) -> None:
    """Raises when a host's containers could not be read: its deployments would vanish from the
    gateway's routes or Prometheus's targets instead of showing as down. `consequence`: what the
    refusal leaves undone ("nothing was changed")."""
    blind = [h for h, s in st.items() if not s["reachable"] or not s["docker"]]
    if blind:
        err = SparkprovError(f"the deployments on {', '.join(blind)} are unknown ("
                             + "; ".join(f"{h}: {'unreachable' if not st[h]['reachable'] else 'docker'}: "
                                         f"{st[h].get('error') or 'docker not reachable'}" for h in blind)
                             + f"): {consequence}", fix="bring the host back, or leave it out with --limit")
        err.exit_code = 4 if any(not st[h]["reachable"] for h in blind) else 2  # the engine's codes
        raise err
