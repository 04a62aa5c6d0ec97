"""listening_ports: every listening TCP and bound UDP port of the host, the process, container and
deployment behind it, and from where it can be reached (loopback, fabric peers, everyone: see
serving/ports.py). Read-only; exports `ports` for `invoke status --ports`, which exits non-zero
when a port open to everyone is neither an API port with a key nor sshd."""

from __future__ import annotations

from sparkprov.facts.fabric import FabricInfo
from sparkprov.facts.ports import FirewallTables, ListeningSockets
from sparkprov.facts.serving import ServingStatus
from sparkprov.modules.base import Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.serving import ports as portmod
from typing import Any



class Args(ModuleArgs):
    pass


def fabric_addresses(fabric: dict) -> list[str]:
    return [r["address"] for r in (fabric or {}).get("rails") or [] if r.get("address")]


PORTS: Export[list[dict[str, Any]]] = Export("ports", list, "every listening port: process, deployment, reach, flag "
                                                            "(serving/ports.py report)")


class ListeningPorts(Module):
    name = "listening_ports"
    Args = Args
    doc = "Report every listening port: process, deployment, and who can reach it (changes nothing)."

    def needs(self, args: Args, host: HostContext):
        return {"sockets": ListeningSockets(), "tables": FirewallTables(), "fabric": FabricInfo(),
                "status": ServingStatus()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        rows = portmod.report(facts.sockets["sockets"], facts.status.get("containers") or [],
                              facts.tables["tables"], fabric_addresses(facts.fabric))
        flagged = [r for r in rows if r["flag"]]
        msg = f"{len(rows)} listening, {len(flagged)} open to everyone without a key" + (
            ": " + ", ".join(f"{r['proto']} {r['address']}:{r['port']} ({', '.join(r['processes']) or '?'})"
                             for r in flagged) if flagged else "")
        return Plan(msg=msg, exports=PORTS(rows))
