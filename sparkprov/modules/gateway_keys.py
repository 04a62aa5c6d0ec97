"""gateway_keys: the API keys of the deployment servers on this host, for the gateway's plan on
another host (exports `gateway_keys`: key file -> key). Reads, never changes; the task runs with
no_log, and the keys live only in the run's memory until they reach the gateway host on stdin."""

from __future__ import annotations

from pydantic import Field

from sparkprov.facts.serving import KeyText
from sparkprov.modules.base import Export, FactView, HostContext, Module, ModuleArgs, Plan


class Args(ModuleArgs):
    key_files: list[str] = Field(min_length=1, max_length=64)


# no_log: the task's result never shows them
GATEWAY_KEYS: Export[dict[str, str]] = Export("gateway_keys", dict, "API key file -> the key in it")


class GatewayKeys(Module):
    name = "gateway_keys"
    Args = Args
    doc = "Read this host's deployment API keys for the gateway (changes nothing; the keys are never shown)."

    def needs(self, args: Args, host: HostContext):
        return {f"key {i}": KeyText(p) for i, p in enumerate(args.key_files)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        keys = {p: facts.named(f"key {i}") for i, p in enumerate(args.key_files)}
        missing = [p for p, k in keys.items() if not k]
        if missing:
            return Plan.fail(f"{host.name}: cannot read the API key file {', '.join(missing)} "
                             f"(fix: invoke cluster-up makes it; check its owner is {host.user or 'the login user'})")
        return Plan(msg=f"{len(keys)} key(s) read", exports=GATEWAY_KEYS(keys))
