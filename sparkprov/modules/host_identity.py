"""host_identity: what machine this is. A DGX Spark (aarch64 + /etc/dgx-release DGX_NAME="DGX
Spark") passes; any other NVIDIA Linux box gets a warning and the run goes on, so sparkprov
also serves datacenter GPU hosts (unless `require_spark: true`).

Reads only the host info the engine gathers first on every host (no extra remote work).
Exports `identity`: {hostname, arch, kernel, os, os_version, dgx_name, dgx_ota_version, is_spark}.
"""

from __future__ import annotations

from sparkprov.modules.base import Export, FactView, HostContext, Module, ModuleArgs, Plan
from typing import TypedDict

SPARK_NAME = "DGX Spark"


class Args(ModuleArgs):
    require_spark: bool = False  # fail instead of warn on a host that is not a DGX Spark


def identity(info: dict[str, str]) -> dict:
    arch = info.get("arch", "")
    dgx = info.get("dgx_name") or None
    return {"hostname": info.get("hostname"), "arch": arch, "kernel": info.get("kernel"),
            "os": info.get("os_pretty_name") or info.get("os_id"), "os_version": info.get("os_version_id"),
            "dgx_name": dgx, "dgx_ota_version": info.get("dgx_ota_version") or None,
            "is_spark": dgx == SPARK_NAME and arch in ("aarch64", "arm64")}


class Identity(TypedDict):
    hostname: str | None
    arch: str
    kernel: str | None
    os: str | None
    os_version: str | None
    dgx_name: str | None
    dgx_ota_version: str | None
    is_spark: bool


IDENTITY: Export[Identity] = Export("identity", Identity, "what the host is: architecture, OS, kernel, DGX name")


class HostIdentityModule(Module):
    name = "host_identity"
    Args = Args
    doc = "Identify the host (arch, /etc/dgx-release, OS, kernel); warn on a non-Spark host."

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        ident = identity(host.info)
        what = (f"NVIDIA DGX Spark (DGX OS {ident['dgx_ota_version'] or '?'})" if ident["is_spark"]
                else ident["dgx_name"] or "generic Linux host")
        msg = f"{what}, {ident['os'] or 'unknown OS'}, kernel {ident['kernel']}, {ident['arch']}"
        problems = []
        if not ident["dgx_name"]:
            problems.append("no /etc/dgx-release with DGX_NAME: not a DGX Spark")
        elif ident["dgx_name"] != SPARK_NAME:
            problems.append(f"/etc/dgx-release says {ident['dgx_name']!r}, not {SPARK_NAME!r}")
        if ident["arch"] not in ("aarch64", "arm64"):
            problems.append(f"architecture is {ident['arch']}, a Spark is aarch64 (GB10 Grace Blackwell)")
        if problems and args.require_spark:
            return Plan.fail(f"{host.name}: " + "; ".join(problems) + " (require_spark is set)",
                             exports=IDENTITY(ident))
        warnings = [f"{host.name}: " + "; ".join(problems) + ": continuing as a generic NVIDIA Linux host "
                    "(GB10-specific checks relaxed)"] if problems else []
        return Plan(msg=msg, warnings=warnings, exports=IDENTITY(ident))
