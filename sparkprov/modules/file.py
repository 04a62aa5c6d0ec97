"""file: a regular file with given content, mode and ownership (or absent)."""

from __future__ import annotations

from typing import Literal

from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, Plan
from sparkprov.facts.files import MAX_CONTENT, PathState
from sparkprov.modules._common import OwnedPathArgs, owned_path, ownership_script
from sparkprov.transport.shell import cmd, heredoc_bytes, quote


class Args(OwnedPathArgs):
    content: str | None = None
    state: Literal["present", "absent"] = "present"


class FileModule(Module):
    name = "file"
    Args = Args
    doc = "A file with the given content, mode, owner and group; written atomically."

    def needs(self, args: Args, host: HostContext):
        return {"path": PathState(args.path, with_content=args.content is not None)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        path, fact, state = owned_path(args, facts, host)
        if args.state == "absent":
            if not state["exists"]:
                return Plan(msg=f"{path} absent")
            if state["type"] == "directory":
                return Plan.fail(f"{path} is a directory; the file module will not remove it")
            return Plan([Change(f"remove {path}", cmd("rm", "-f", "--", path),
                                Diff(path, _text(state.get("content")), ""), [fact])])
        if state["exists"] and state["type"] != "file":
            return Plan.fail(f"{path} exists and is a {state['type']}, not a file")
        changes: list[Change] = []
        data = args.content.encode() if args.content is not None else None
        if not state["exists"] or data is not None and _differs(state, data):
            if data is None:
                data = b""
            tmp = f"{path}.sparkprov-tmp"
            mode = args.mode or (format(state["mode"], "04o") if state["exists"] else "0644")
            owner = args.owner or (state.get("owner") if state["exists"] else None)
            group = args.group or (state.get("group") if state["exists"] else None)
            lines = ["umask 077", heredoc_bytes(data, "cat > " + quote(tmp)).rstrip("\n"),
                     cmd("chmod", mode, "--", tmp)]
            if owner or group:
                lines.append(cmd("chown", (owner or "") + (":" + group if group else ""), "--", tmp))
            lines.append(cmd("mv", "-f", "--", tmp, path))
            before = _text(state.get("content")) if state["exists"] else ""
            verb = "update" if state["exists"] else "create"
            changes.append(Change(f"{verb} {path} ({len(data)} bytes, mode {mode})", "\n".join(lines),
                                  Diff(path, before, _text(data)), [fact]))
        else:
            scripts, notes = ownership_script(path, args, state)
            if scripts:
                changes.append(Change(f"{path}: " + ", ".join(notes), "\n".join(scripts),
                                      Diff(path + " (metadata)", _meta(state), _meta_after(state, args)), [fact]))
        return Plan(changes, msg=f"{path} as wanted")


def _differs(state: dict, data: bytes) -> bool:
    import hashlib

    return state.get("sha256") != hashlib.sha256(data).hexdigest()


def _text(data: bytes | None) -> str:
    if data is None:
        return ""
    if len(data) > MAX_CONTENT:
        return f"<{len(data)} bytes>"
    try:
        return data.decode()
    except UnicodeDecodeError:
        return f"<{len(data)} bytes of binary>"


def _meta(state: dict) -> str:
    return f"mode={format(state['mode'], '04o')} owner={state['owner']} group={state['group']}\n"


def _meta_after(state: dict, args: OwnedPathArgs) -> str:
    mode = args.mode or format(state["mode"], "04o")
    return f"mode={mode} owner={args.owner or state['owner']} group={args.group or state['group']}\n"
