"""fabric_rails: this host's fabric rail addresses, for another host's plan (exports
`fabric_rails`: [{iface, address, prefix}]). Reads, never changes. `invoke monitor` reads them to
know where each node guard answers (on loopback and the fabric addresses only)."""

from __future__ import annotations

from sparkprov.facts.fabric import FabricInfo
from sparkprov.modules.base import Export, FactView, HostContext, Module, ModuleArgs, Plan
from typing import TypedDict



class Args(ModuleArgs):
    pass


def rails_of(fabric: dict) -> list[RailAddress]:
    return [{"iface": r["iface"], "address": r["address"], "prefix": r["prefix"]}
            for r in (fabric or {}).get("rails") or [] if r.get("address")]


class RailAddress(TypedDict):
    iface: str
    address: str
    prefix: int


FABRIC_RAILS: Export[list[RailAddress]] = Export("fabric_rails", list, "the host's fabric rail addresses")


class FabricRails(Module):
    name = "fabric_rails"
    Args = Args
    doc = "Report this host's fabric rail addresses for another host's plan (changes nothing)."

    def needs(self, args: Args, host: HostContext):
        return {"fabric": FabricInfo()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        rails = rails_of(facts.fabric)
        return Plan(msg=", ".join(f"{r['iface']} {r['address']}/{r['prefix']}" for r in rails) or "no fabric address",
                    exports=FABRIC_RAILS(rails))
