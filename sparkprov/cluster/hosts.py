"""Connecting to the hosts of a serve command and reading their facts: one gather (one remote
call) per host, the sudo probe riding along in it."""

from __future__ import annotations

import posixpath
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from sparkprov.catalog.render import DEFAULT_API_KEY_FILE
from sparkprov.data.inventory import Host, Inventory
from sparkprov.engine.facts import Fact, HostInfo, ShellCtx, build_gather, parse_gather
from sparkprov.engine.run import BecomePassword, become_from_probe, make_transport
from sparkprov.errors import SparkprovError
from sparkprov.transport.base import ExecResult, Transport, Unreachable

DEFAULT_KEY_FILE = DEFAULT_API_KEY_FILE
DEFAULT_STORE = "~/vllm"
DEFAULT_PORT = 8000


@dataclass
class Node:
    host: Host
    transport: Transport | None = None
    info: dict[str, str] = field(default_factory=dict)
    values: dict[tuple, Any] = field(default_factory=dict)
    errors: dict[tuple, str] = field(default_factory=dict)
    become_how: str | None = None
    unreachable: str | None = None

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def vars(self) -> dict[str, Any]:
        return self.host.vars

    @property
    def home(self) -> str:
        return self.info.get("home", "")

    def fact(self, f: Fact) -> Any:
        if f.key in self.errors:
            raise SparkprovError(f"{self.name}: cannot read {f}: {self.errors[f.key]}")
        if f.key not in self.values:
            raise SparkprovError(f"{self.name}: {f} was not read")
        return self.values[f.key]

    def path(self, p: str) -> str:
        if p == "~" or p.startswith("~/"):
            return posixpath.normpath(self.home.rstrip("/") + p[1:])
        return p

    def key_file(self) -> str | None:
        v = self.vars.get("api_key_file", DEFAULT_KEY_FILE)
        return None if v in (None, "", False) else self.path(str(v))

    def store(self) -> str:
        return self.path(str(self.vars.get("model_store") or DEFAULT_STORE))

    def run(self, script: str, *, become: bool = False, timeout: float | None = None) -> ExecResult:
        return self.transport.run_script(script, become=become, timeout=timeout)

    def can_become(self) -> bool:
        return self.transport is not None and self.transport.become_method is not None


def connect_and_gather(inventory: Inventory, names: list[str], facts_for: Callable[[Node], Iterable[Fact]], *,
                       accept_new_host_keys: bool = False, become: bool = True, forks: int = 32) -> dict[str, Node]:
    """Connect to every host and read its facts in one call each (in parallel)."""
    password = BecomePassword(interactive=sys.stdin.isatty())

    def one(name: str) -> Node:
        node = Node(inventory.hosts[name])
        node.transport = make_transport(node.host, accept_new_host_keys)
        try:
            node.transport.connect()
            wanted: dict[tuple, Fact] = {HostInfo().key: HostInfo()}
            for f in facts_for(node):
                wanted[f.key] = f
            pw = password.configured(node.host) if become else None
            gs = build_gather(list(wanted.values()), ShellCtx(None), become=False, password=pw, probe_become=become)
            res = node.transport.run_script(gs.script)
            parsed = parse_gather(gs, res.stdout)
            node.values, node.errors = parsed.values, parsed.errors
            if HostInfo().key not in parsed.values:
                raise SparkprovError(f"{name}: cannot read host facts: "
                                     f"{parsed.errors.get(HostInfo().key) or res.stderr.strip()[:200]}")
            node.info = parsed.values[HostInfo().key]
            node.become_how = parsed.become
            # a password that is missing or wrong leaves become unknown: steps that need root say so
            become_from_probe(node.transport, parsed.become, pw)
        except Unreachable as exc:
            node.unreachable = exc.line()
        except SparkprovError as exc:
            node.unreachable = exc.line()
        return node

    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(names)))) as pool:
        return {n.name: n for n in pool.map(one, names)}


def regather(node: Node, facts: Iterable[Fact]) -> None:
    """Read some facts again (one call), e.g. after staging or pulling."""
    facts = list(facts)
    gs = build_gather(facts, ShellCtx(node.home or None), become=False, password=None, probe_become=False)
    res = node.run(gs.script)
    parsed = parse_gather(gs, res.stdout)
    for f in facts:
        node.values.pop(f.key, None)
        node.errors.pop(f.key, None)
    node.values.update(parsed.values)
    node.errors.update(parsed.errors)


def close_all(nodes: dict[str, Node], report=None) -> None:
    """Close every node's connection; with a report, record each host's remote calls first."""
    for name, n in nodes.items():
        if n.transport is not None:
            if report is not None:
                report.hosts[name].remote_calls = n.transport.remote_calls
            n.transport.close()


def become_fix(node: Node) -> str:
    return {"password-bad": "sudo rejected the password: check become_password_env / become_password_file",
            "nosudo": "install sudo or connect as root",
            "password-needed": "set become_password_env or become_password_file in the inventory "
                               "(or SPARKPROV_BECOME_PASSWORD)"}.get(node.become_how or "", "check sudo on the host")
