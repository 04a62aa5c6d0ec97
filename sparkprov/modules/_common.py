"""Pieces the file-like modules share: octal modes, ownership changes, safe paths."""

from __future__ import annotations

import posixpath
import re

from pydantic import field_validator

from sparkprov.facts.base import Fact
from sparkprov.modules.base import ModuleArgs
from sparkprov.transport.shell import cmd

_OWNER_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}\$?$|^[0-9]+$")


def owned_path(args: "OwnedPathArgs", facts, host) -> tuple[str, Fact, dict]:
    """The module's path as the host sees it (~ expanded), its `path` fact (PathState) and what it read."""
    return host.path(args.path), facts.fact("path"), facts.path


class OwnedPathArgs(ModuleArgs):
    path: str
    mode: str | None = None
    owner: str | None = None
    group: str | None = None

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, v):
        # YAML reads an unquoted 0600 as the octal integer 384; a quoted "0600" stays text.
        if v is None:
            return None
        if isinstance(v, int) and not isinstance(v, bool):
            v = format(v, "o")
        if not isinstance(v, str) or not re.fullmatch(r"0?[0-7]{3,4}", v):
            raise ValueError(f"mode must be octal like \"0644\", got {v!r}")
        return v.rjust(4, "0")

    @field_validator("owner", "group")
    @classmethod
    def _owner(cls, v):
        if v is not None and not _OWNER_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a user or group name")
        return v

    @field_validator("path")
    @classmethod
    def _path(cls, v):
        if not (v.startswith("/") or v == "~" or v.startswith("~/")):
            raise ValueError(f"path must be absolute or start with ~/, got {v!r}")
        if "\0" in v or "\n" in v:
            raise ValueError("path must not contain NUL or newline")
        norm = posixpath.normpath(v)
        if norm in ("/", "~"):
            raise ValueError(f"refusing to manage {v!r} itself")
        return norm


def ownership_script(path: str, args: OwnedPathArgs, state: dict) -> tuple[list[str], list[str]]:
    """Commands to fix mode/owner/group of an existing path, with a summary of each."""
    scripts, notes = [], []
    if args.owner and state.get("owner") != args.owner or args.group and state.get("group") != args.group:
        spec = (args.owner or "") + (":" + args.group if args.group else "")
        scripts.append(cmd("chown", "-h", spec, "--", path))
        notes.append(f"owner {state.get('owner')}:{state.get('group')} -> "
                     f"{args.owner or state.get('owner')}:{args.group or state.get('group')}")
    if args.mode and state.get("mode") != int(args.mode, 8):
        scripts.append(cmd("chmod", args.mode, "--", path))
        notes.append(f"mode {format(state.get('mode') or 0, '04o')} -> {args.mode}")
    return scripts, notes
