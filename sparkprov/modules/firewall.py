"""firewall: a multi-node deployment's internal ports reachable from its members only (nftables).

Ray's GCS, raylet, object manager and workers, vLLM's native rendezvous and data-parallel RPC
port, Gloo, NCCL and ZMQ listen on every interface whatever address they advertise (measured:
docs/security.md). On every member, the deployment's own table `inet sparkprov-NAME` drops new
connections to those ports (serving/ports.py: internal_ports) from anyone but the members' fabric
addresses and loopback; the API port (on rank 0) and sshd stay open. The table is loaded from
/etc/sparkprov/nftables/NAME.nft, which the boot loads again (the unit sparkprov-firewall.service,
enabled here, before docker.service starts the containers): the rules survive a reboot as the
deployment does. `state: absent` removes the tables (and files) of the named deployments, or of
every deployment; nothing else in nftables is touched.
"""

from __future__ import annotations

import posixpath
from typing import Literal

from pydantic import Field, model_validator

from sparkprov.facts.base import SYSTEMD_IS_INIT
from sparkprov.facts.files import PathState
from sparkprov.facts.ports import TABLE_PREFIX, EphemeralPorts, FirewallTables, RuleFiles
from sparkprov.modules._serving import preflight_export
from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.serving import ports as portmod
from sparkprov.serving.deployment import Deployment
from sparkprov.transport.shell import cmd, quote

RULES_DIR = "/etc/sparkprov/nftables"
UNIT = "sparkprov-firewall.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
WANTS = f"/etc/systemd/system/multi-user.target.wants/{UNIT}"
UNIT_TEXT = f"""[Unit]
Description=sparkprov: each deployment's internal ports open to its members only (nftables)
DefaultDependencies=no
Before=network-pre.target docker.service
Wants=network-pre.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'for f in {RULES_DIR}/*.nft; do [ ! -e "$f" ] || /usr/sbin/nft -f "$f" || exit 1; done'

[Install]
WantedBy=multi-user.target
"""
# systemctl where systemd runs; elsewhere (a container, the lab) the link `systemctl enable` makes
ENABLE = (f"if {SYSTEMD_IS_INIT} && command -v systemctl >/dev/null 2>&1; then systemctl daemon-reload "
          f"&& systemctl enable --quiet {UNIT}; else mkdir -p {posixpath.dirname(WANTS)} && "
          f"ln -sfn ../{UNIT} {WANTS}; fi")


def rules_file(deployment: str) -> str:
    return f"{RULES_DIR}/{deployment}.nft"


class Args(ModuleArgs):
    state: Literal["present", "absent"] = "present"
    deployment: Deployment | None = None          # present: the deployment this member belongs to
    deployments: list[str] | None = Field(default=None, max_length=256)  # absent: these (None: every one)

    @model_validator(mode="after")
    def _what(self):
        if self.state == "present" and self.deployment is None:
            raise ValueError("state present needs deployment")
        return self


def _write(path: str, text: str) -> str:
    return "\n".join(["umask 077", f"mkdir -p {quote(posixpath.dirname(path))}",
                      f"cat > {quote(path + '.new')} <<'SPARKPROV_NFT'\n{text}SPARKPROV_NFT",
                      f"mv {quote(path + '.new')} {quote(path)}"])


class Firewall(Module):
    name = "firewall"
    Args = Args
    doc = ("A multi-node deployment's internal ports (Ray, vLLM rendezvous, Gloo/NCCL) reachable only from its "
           "members' fabric addresses: one nftables table per deployment, persisted and loaded at boot.")

    def needs(self, args: Args, host: HostContext):
        named = {"tables": FirewallTables()}
        if args.state == "absent":
            named["files"] = RuleFiles(RULES_DIR)
        else:
            named.update({"ephemeral": EphemeralPorts(), "file": PathState(rules_file(args.deployment.name), True),
                          "unit": PathState(UNIT_PATH, True), "wants": PathState(WANTS)})
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        return self._absent(args, facts, host) if args.state == "absent" else self._present(args, facts, host)

    def _present(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        dep = args.deployment
        if not dep.cluster:
            return Plan(msg=f"{dep.name} runs on one node: no internal port is reachable from another")
        tables = facts.tables
        if not tables["nft"]:
            return Plan.fail(f"{host.name}: nft is not installed: the internal ports of {dep.name} would be open to "
                             "every network (fix: apt-get install nftables)")
        found = {h: preflight_export(host, h, dep.name) for h in dep.hosts}
        missing = [h for h, e in found.items() if not e.get("node_ip")]
        if missing:
            return Plan.fail(f"{host.name}: no fabric address exported by {', '.join(missing)} (their preflight failed)")
        # every rail address of every member (NCCL and Gloo may use both twins), VLLM_HOST_IP first
        members = list(dict.fromkeys(a for e in found.values() for a in [e["node_ip"], *(e.get("rails") or [])]))
        open_ports = [portmod.SSH_PORT] + ([dep.port_on(host.vars)] if dep.serves_on(host.name) else [])
        closed = portmod.internal_ports(dep.executor, ray_port=dep.ray_port, master_port=dep.master_port,
                                        ephemeral=facts.ephemeral)
        text = portmod.ruleset(dep.name, [str(m) for m in members], open_ports, closed)
        name, path = portmod.table_name(dep.name), rules_file(dep.name)
        live = tables["tables"].get(name)
        f = facts.file
        have = f.get("content", b"").decode(errors="replace") if f.get("exists") else ""
        want_hash = portmod.ruleset_hash(text)
        changes = []
        if have != text or (live or {}).get("comment") != want_hash:
            why = ("absent" if live is None and not have else "not loaded" if live is None
                   else "changed" if have != text else "live rules differ from the file")
            changes.append(Change(
                f"{'load' if live is None else 'replace'} nftables table {name}: {dep.name}'s internal ports only "
                f"from {', '.join(members)} ({why})",
                _write(path, text) + "\n" + cmd("nft", "-f", path),
                Diff(f"{host.name}: {path}", have, text), touches=[facts.fact("tables"), facts.fact("file")],
                become=True, predicts=[(facts.fact("file"), {**f, "exists": True, "content": text.encode()})]))
        unit = facts.unit
        if unit.get("content", b"").decode(errors="replace") != UNIT_TEXT or not facts.wants.get("exists"):
            changes.append(Change(f"{UNIT}: load {RULES_DIR}/*.nft at boot, before docker starts the containers",
                                  _write(UNIT_PATH, UNIT_TEXT) + f"\nchmod 644 {UNIT_PATH}\n" + ENABLE,
                                  Diff(f"{host.name}: {UNIT_PATH}", unit.get("content", b"").decode(errors="replace"),
                                       UNIT_TEXT), touches=[facts.fact("unit"), facts.fact("wants")], become=True))
        if not changes:
            return Plan(msg=f"{name}: internal ports of {dep.name} only from {', '.join(members)}")
        return Plan(changes)

    def _absent(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        tables = facts.tables
        wanted = None if args.deployments is None else set(args.deployments)
        gone = sorted(t for t in tables["tables"] if wanted is None or t[len(TABLE_PREFIX):] in wanted)
        files = [n for n in facts.files if wanted is None or n in wanted]  # else loaded again at boot
        if not gone and not files:
            return Plan(msg="no sparkprov table")
        script = "\n".join([*(cmd("nft", "delete", "table", "inet", t) for t in gone),
                            *(cmd("rm", "-f", rules_file(n)) for n in files)])
        what = ", ".join(gone) or "(none loaded)"
        return Plan([Change(f"remove nftables table{'s' if len(gone) > 1 else ''} {what} and its rule files", script,
                            Diff(f"{host.name}: nftables", "\n".join(gone + [rules_file(n) for n in files]) + "\n", ""),
                            touches=[facts.fact("tables"), facts.fact("files")], become=True,
                            predicts=[(facts.fact("tables"), {**tables, "tables": {
                                k: v for k, v in tables["tables"].items() if k not in gone}}),
                                      (facts.fact("files"), [n for n in facts.files if n not in files])])])
