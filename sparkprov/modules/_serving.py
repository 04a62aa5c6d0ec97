"""What the serving modules share: the deployment they act for, and reading the exports of the
plays before them (rank 0's fabric address, every node's image ID)."""

from __future__ import annotations

from typing import TypedDict

from sparkprov.modules.base import Export, HostContext, ModuleArgs
from sparkprov.serving.deployment import Deployment



class Preflight(TypedDict, total=False):
    node_ip: str | None   # a multi-node deployment's node: its address on the fabric rail it serves over
    rail_net: str | None  # ... that rail's network
    rails: list[str]      # every rail's address: the members the firewall lets reach the internals


# serve_preflight writes it; declared here, beside the readers of every serving module, because
# serve_preflight imports this module
PREFLIGHT: Export[dict[str, Preflight]] = Export("serve_preflight", dict, "deployment -> what its preflight found here")


class ServeArgs(ModuleArgs):
    deployment: Deployment


def preflight_export(host: HostContext, name: str, deployment: str) -> Preflight:
    """What the preflight play found on host `name` for this deployment ({} when it did not run there)."""
    return PREFLIGHT.entry(host.exports, name, deployment) or {}


def head_ip(host: HostContext, dep: Deployment) -> str | None:
    """Rank 0's fabric address, as rank 0's preflight exported it."""
    return preflight_export(host, dep.hosts[0], dep.name).get("node_ip") if dep.cluster else None
