"""What the serving modules share: the deployment they act for, and reading the exports of the
plays before them (rank 0's fabric address, every node's image ID)."""

from __future__ import annotations

from typing import Any

from sparkprov.modules.base import HostContext, ModuleArgs
from sparkprov.serving.deployment import Deployment

PREFLIGHT = "serve_preflight"  # the export key the preflight writes per host


class ServeArgs(ModuleArgs):
    deployment: Deployment


def preflight_export(host: HostContext, name: str, deployment: str) -> dict[str, Any]:
    """What the preflight play found on host `name` for this deployment ({} when it did not run there)."""
    return ((host.exports.get(name) or {}).get(PREFLIGHT) or {}).get(deployment) or {}


def head_ip(host: HostContext, dep: Deployment) -> str | None:
    """Rank 0's fabric address, as rank 0's preflight exported it."""
    return preflight_export(host, dep.hosts[0], dep.name).get("node_ip") if dep.cluster else None
