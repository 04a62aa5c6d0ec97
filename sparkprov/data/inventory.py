"""The inventory: which hosts exist, how to reach them, and their variables.

    defaults:  {user, port, ssh_key, known_hosts, connection, become_password_env, ...}
    hosts:     {NAME: {address, port, user, ssh_key, connection: ssh|local, vars: {...}}}
    groups:    {GROUP: [host-or-group, ...]}  or  {GROUP: {hosts: [...], vars: {...}}}
    vars:      {...}   # for every host; group vars override these, host vars override both
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sparkprov.errors import InputError
from sparkprov.facts.topology import check_var as check_fabric_var
from sparkprov.hosts import Host, Inventory, close_match
from sparkprov.imageref import IMAGE_RE
from sparkprov.inventory_vars import valid_address
from sparkprov.yamlpos import Positions, load_yaml, parse_model

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
RESERVED = {"all", "localhost"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Connection(_Strict):
    """How to reach a host; every field may come from `defaults`."""

    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    ssh_key: str | None = None
    known_hosts: str | None = None
    connection: Literal["ssh", "local"] | None = None
    become_password_env: str | None = None
    become_password_file: str | None = None
    # bounded: `.inf` or a day-long timeout would make an unreachable host hang the run
    connect_timeout: float | None = Field(default=None, gt=0, le=3600, allow_inf_nan=False)

    @field_validator("port", "connect_timeout", mode="before")
    @classmethod
    def _not_bool(cls, v):
        # YAML's `true` is a bool, and bool is an int to Python: `port: true` would be port 1
        if isinstance(v, bool):
            raise ValueError(f"{str(v).lower()} is a boolean, not a number")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v):
        if v is not None and not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}\$?", v):
            raise ValueError(f"{v!r} is not a valid user name")
        return v


    @field_validator("ssh_key", "known_hosts", "become_password_file")
    @classmethod
    def _path(cls, v):
        if v is not None and (not v.strip() or any(not c.isprintable() for c in v)):
            raise ValueError(f"{v!r} is not a usable file path")
        return v

    @field_validator("become_password_env")
    @classmethod
    def _env(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"{v!r} is not an environment variable name")
        return v


class HostEntry(Connection):
    address: str | None = None
    vars: dict[str, Any] = Field(default_factory=dict)

    @field_validator("address")
    @classmethod
    def _address(cls, v):
        if v is not None and not valid_address(v):
            fix = ""
            if v.startswith("["):
                fix = " (write an IPv6 address without brackets, and a port as port:)"
            elif v.startswith("-"):
                fix = " (it would read as an option to ssh and rsync)"
            raise ValueError(f"{v!r} is not a host name or IP address{fix}")
        return v


class GroupEntry(_Strict):
    hosts: list[str] = Field(default_factory=list)
    vars: dict[str, Any] = Field(default_factory=dict)


class InventoryFile(_Strict):
    defaults: Connection = Field(default_factory=Connection)
    hosts: dict[str, HostEntry | None] = Field(default_factory=dict)
    groups: dict[str, GroupEntry | list[str]] = Field(default_factory=dict)
    vars: dict[str, Any] = Field(default_factory=dict)




def _check_vars(model: InventoryFile, pos: Positions) -> None:
    """Every variable sparkprov reads is checked against its declaration (sparkprov/inventory_vars.py)
    where it is written, so `recipe --host`, `plan`, `cluster-up` and the guard never meet it
    half-valid later; a variable of the user's own that is close to a declared one is named."""
    from sparkprov import inventory_vars as iv

    hosts = [str(h) for h in model.hosts]
    for prefix, variables in _scopes(model):
        for name, value in variables.items():
            where = prefix + (name,)
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", name):
                raise pos.error(where, f"variable name {name!r} is not an identifier", key=True,
                                fix="use letters, digits and _ (not starting with a digit)")
            var = iv.VARS.get(name)
            if var is None:
                close = iv.close_to_declared(name)
                if close:
                    raise pos.error(where, f"unknown variable {name!r}", key=True, fix=iv.unknown_fix(name, close))
                continue
            if value is None:
                continue
            try:
                var.check(value)
            except iv.VarError as exc:
                raise pos.error(where, exc.message, fix=exc.fix) from None
            rule = getattr(var.kind, "rule", "")
            if rule == "url":
                _check_url_var(pos, where, name, value)
            elif rule == "image":
                if not IMAGE_RE.match(value):
                    raise pos.error(where, f"{name}: {value!r} is not an image reference",
                                    fix="e.g. ghcr.io/berriai/litellm:main-stable (registry/repo[:tag][@sha256:...])")
            elif rule == "fabric":  # the fabric's topology (issue 34): its rule is facts/topology.py's
                bad = check_fabric_var(name, value, hosts=hosts)
                if bad:
                    raise pos.error(where, bad[0], fix=bad[1])
            elif rule == "host" and value not in hosts:
                close = close_match(value, hosts)
                raise pos.error(where, f"{name}: {value!r} is not a host of this inventory",
                                fix=f"did you mean {close!r}?" if close else "name a host under hosts:")


def _scopes(model: InventoryFile) -> list[tuple[tuple, dict]]:
    """Where variables are written: (path in the document, the mapping), widest first."""
    scopes: list[tuple[tuple, dict]] = [(("vars",), model.vars)]
    for g, entry in model.groups.items():
        if isinstance(entry, GroupEntry):
            scopes.append((("groups", g, "vars"), entry.vars))
    for h, entry in model.hosts.items():
        if entry is not None:
            scopes.append((("hosts", h, "vars"), entry.vars))
    return scopes


def _check_rails(inventory: "Inventory") -> None:
    """A host's rail floor may not be above its expected figure (fabric_qualify's rule), said at the
    floor's line before any host is measured."""
    from sparkprov import inventory_vars as iv

    for name, host in inventory.hosts.items():
        floor, expected = iv.value(host.vars, "rail_min_gbps"), iv.value(host.vars, "rail_expected_gbps")
        if floor > expected:
            raise inventory.var_error(name, "rail_min_gbps",
                                      f"rail_min_gbps {floor:g} is above rail_expected_gbps {expected:g} for host {name}",
                                      fix="the floor must be the lower figure")


def _check_url_var(pos: Positions, where: tuple, name: str, value: Any) -> None:
    """The hub endpoint as stage-weights will use it (staging.hub.check_endpoint's rule), so a bad
    one is refused at its line before any host or hub is asked."""
    from sparkprov.errors import SparkprovError
    from sparkprov.staging.hub import check_endpoint

    if not isinstance(value, str):
        raise pos.error(where, f"{name}: {value!r} is not a URL", fix="write it as a string, e.g. https://huggingface.co")
    try:
        check_endpoint(value)
    except SparkprovError as exc:
        raise pos.error(where, exc.message, fix=exc.fix) from None


def implicit_localhost() -> Host:
    return Host(name="localhost", address="localhost", connection="local")


def load_inventory(path: str | Path) -> Inventory:
    from sparkprov.inputfiles import MAX_INVENTORY

    data, pos = load_yaml(path, what="inventory", max_bytes=MAX_INVENTORY)
    file = str(path)
    if data is None:  # an empty file (or only comments): almost always the wrong path
        raise InputError("the inventory is empty", file=file, line=1, column=1,
                         fix="add hosts: (see inventory.yaml in the sparkprov repository)")
    if not isinstance(data, dict):
        raise pos.error((), "an inventory must be a mapping with hosts:, groups:, vars:",
                        fix="see inventory.yaml in the sparkprov repository")
    model: InventoryFile = parse_model(InventoryFile, data, pos)
    _check_vars(model, pos)
    defaults = model.defaults
    hosts: dict[str, Host] = {}
    for name, entry in model.hosts.items():
        name = str(name)
        if not NAME_RE.fullmatch(name) or name == "all":
            raise pos.error(("hosts", name), f"invalid host name {name!r}", key=True,
                            fix="use letters, digits, '.', '_' and '-'")
        entry = entry or HostEntry()
        settings: dict[str, Any] = {}
        for field in Connection.model_fields:
            value = getattr(entry, field)
            settings[field] = value if value is not None else getattr(defaults, field)
        connection = settings.pop("connection") or ("local" if name == "localhost" else "ssh")
        address = entry.address or name
        if settings["connect_timeout"] is None:
            settings.pop("connect_timeout")
        hosts[name] = Host(name=name, address=address, connection=connection, **settings,
                           vars={**model.vars})
    groups = _flatten_groups(model, hosts, pos, file)
    for gname, gentry in model.groups.items():  # group vars, then host vars on top
        if isinstance(gentry, GroupEntry):
            for h in groups[gname]:
                hosts[h].vars.update(gentry.vars)
    for name, entry in model.hosts.items():
        if entry is not None:
            hosts[str(name)].vars.update(entry.vars)
    for gname, members in groups.items():
        for h in members:
            hosts[h].groups.append(gname)
    inventory = Inventory(file, hosts, groups, pos, [str(g) for g in model.groups])
    _check_rails(inventory)
    return inventory


def _flatten_groups(model: InventoryFile, hosts: dict[str, Host], pos: Positions, file: str) -> dict[str, list[str]]:
    raw = {str(g): (e.hosts if isinstance(e, GroupEntry) else e) for g, e in model.groups.items()}
    for g in raw:
        if not NAME_RE.fullmatch(g) or g in RESERVED:
            raise pos.error(("groups", g), f"invalid group name {g!r}", key=True,
                            fix="pick another name (all and localhost are reserved)")
        if g in hosts:
            raise pos.error(("groups", g), f"group {g!r} has the same name as a host", key=True,
                            fix="rename the group")
    out: dict[str, list[str]] = {}

    def expand(group: str, stack: tuple[str, ...]) -> list[str]:
        if group in out:
            return out[group]
        if group in stack:
            raise pos.error(("groups", group), f"group {group!r} includes itself through {' -> '.join(stack)}",
                            fix="remove the cycle")
        members: list[str] = []
        entry = model.groups[group]
        base = ("groups", group, "hosts") if isinstance(entry, GroupEntry) else ("groups", group)
        for i, member in enumerate(raw[group]):
            member = str(member)
            if member in hosts:
                found = [member]
            elif member in raw:
                found = expand(member, stack + (group,))
            else:
                close = close_match(member, list(hosts)) or close_match(member, list(raw))
                raise pos.error(base + (i,), f"group {group!r} names unknown host {member!r}",
                                fix=f"did you mean {close!r}?" if close else "add it under hosts:")
            members.extend(h for h in found if h not in members)
        out[group] = members
        return members

    for g in raw:
        expand(g, ())
    return out


# The files an inventory names, with the limit each may have (sparkprov/inputfiles.py).
_HOST_FILES = {"ssh_key": "MAX_KEY", "known_hosts": "MAX_KNOWN_HOSTS", "become_password_file": "MAX_SECRET"}


def check_host_files(inventory: Inventory, names: list[str]) -> None:
    """The files the selected hosts' settings name are regular files of sane size, checked before
    any host is touched; the error points at the setting in the inventory. A file that does not
    exist is left to the step that needs it: known_hosts is created by --accept-new-host-keys, the
    lab's files exist only while it is up, and a run that needs no sudo never reads the password."""
    import os

    from sparkprov import inputfiles

    seen: set[tuple[str, str]] = set()
    for name in names:
        host = inventory.hosts[name]
        _check_password_env(inventory, host)
        for attr, limit in _HOST_FILES.items():
            value = getattr(host, attr)
            if not value or (attr, value) in seen:
                continue
            seen.add((attr, value))
            path = os.path.expanduser(value)
            if not os.path.lexists(path):
                continue
            try:
                inputfiles.check_regular_file(path, attr, getattr(inputfiles, limit))
            except InputError as exc:
                at = ("hosts", name, attr) if ("hosts", name, attr) in inventory.pos.marks else ("defaults", attr)
                line, col = inventory.pos.at(at)
                raise InputError(f"{attr} {value!r} of host {name}: {exc.message.split(': ', 1)[-1]}",
                                 file=inventory.path, line=line, column=col, fix=exc.fix) from None



def _check_password_env(inventory: Inventory, host: Host) -> None:
    """sudo reads one line: a password from the environment with a line break or NUL would be cut
    and the rest read as input. Said once, at the setting, before any host (the engine would say
    it per host, inside the play). The value is never shown."""
    import os

    var = host.become_password_env
    where = None
    if var and os.environ.get(var):
        at = ("hosts", host.name, "become_password_env")
        where = at if at in inventory.pos.marks else ("defaults", "become_password_env")
    elif not var and not host.become_password_file and os.environ.get("SPARKPROV_BECOME_PASSWORD"):
        var = "SPARKPROV_BECOME_PASSWORD"
    else:
        return
    if not any(c in os.environ[var] for c in "\n\r\0"):
        return
    message = f"the sudo password in ${var} holds a line break or NUL"
    fix = f"set {var} to the password alone, on one line"
    if where is None:
        raise InputError(message, fix=fix)
    line, col = inventory.pos.at(where)
    raise InputError(f"become_password_env of host {host.name}: {message}", file=inventory.path, line=line,
                     column=col, fix=fix)
