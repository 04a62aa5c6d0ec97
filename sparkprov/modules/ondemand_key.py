"""ondemand_key: the key that signs the gateway's requests to the nodes' guards (node/ondemand.py),
for `gateway up` with on-demand deployments (docs/on-demand.md).

role gateway (the gateway host, its login user): the key in ~/.config/sparkprov/gateway/ondemand_key
(0600), made there once (32 random bytes, 64 hex digits) and read after; exported (`ondemand_key`)
for the nodes' tasks. role node (as root): the same key in the file the guard reads at each request
(/etc/sparkprov/ondemand.key, 0600 root), written where its content differs; state absent removes it
(`gateway down`). Every task of it runs with no_log; the key reaches a host only inside a script on
stdin, never an argv, and no diff or message shows it (a digest neither).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Literal

from pydantic import Field

from sparkprov.facts.files import PathState
from sparkprov.facts.serving import KeyText
from sparkprov.modules._provision import write_file_script
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.node import guard as g
from sparkprov.node import ondemand as od
from sparkprov.serving import gateway as gw
from sparkprov.transport.shell import cmd

NODE_PATH = g.INTERNAL["ondemand_key"]
GATEWAY_PATH = f"{gw.DIR}/{gw.ONDEMAND_KEY}"


class Args(ModuleArgs):
    role: Literal["gateway", "node"]
    state: Literal["present", "absent"] = "present"
    source: str | None = Field(default=None, min_length=1)  # node: the gateway host whose key it places


ONDEMAND_KEY: Export[str] = Export("ondemand_key", str, "the on-demand key (64 hex digits; no_log)")


def new_key() -> str:
    return secrets.token_hex(od.KEY_BYTES)


class OnDemandKey(Module):
    name = "ondemand_key"
    Args = Args
    doc = "The key of the gateway's signed requests to the guards: made on the gateway host, placed on the nodes."

    def needs(self, args: Args, host: HostContext):
        if args.role == "gateway":
            return {"key": KeyText(GATEWAY_PATH)}
        return {"file": PathState(NODE_PATH)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        if args.role == "gateway":
            have = facts.key
            if od.parse_key(have or "") is not None:
                return Plan(msg="the on-demand key is there", exports=ONDEMAND_KEY(have))
            key = new_key()
            return Plan([Change(f"make the on-demand key ({GATEWAY_PATH}, 0600)",
                                write_file_script(host.path(GATEWAY_PATH), (key + "\n").encode(), mode="0600"),
                                Diff(GATEWAY_PATH, "" if have is None else "(not a key)\n", "(a new key, 0600)\n"),
                                [facts.fact("key")])], exports=ONDEMAND_KEY(key))
        have = facts.file
        if args.state == "absent":
            if not have.get("exists"):
                return Plan(msg="no on-demand key")
            return Plan([Change(f"remove the on-demand key {NODE_PATH}", cmd("rm", "-f", "--", NODE_PATH),
                                Diff(NODE_PATH, "(the gateway's key)\n", ""), [facts.fact("file")])])
        key = ONDEMAND_KEY.read(host.exports, args.source or "")
        if not key:
            return Plan.fail(f"{host.name}: the on-demand key of the gateway on {args.source} was not read (its "
                             "ondemand_key task failed or did not run)")
        data = (key + "\n").encode()
        if have.get("exists") and have.get("sha256") == hashlib.sha256(data).hexdigest() \
                and have.get("mode") == 0o600 and have.get("owner") == "root":
            return Plan(msg="the gateway's on-demand key is there")
        return Plan([Change(f"{'replace' if have.get('exists') else 'write'} the on-demand key {NODE_PATH} (0600 root)",
                            write_file_script(NODE_PATH, data, mode="0600", owner="root", group="root"),
                            Diff(NODE_PATH, "(another key)\n" if have.get("exists") else "",
                                 f"(the gateway's key, from {args.source})\n"), [facts.fact("file")])])
