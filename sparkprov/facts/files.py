"""Facts about paths: type, mode, owner, size, hash, and (for small files) content."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx

MAX_CONTENT = 256 * 1024  # larger files are compared by hash only


@dataclass(frozen=True)
class PathState(Fact):
    path: str
    with_content: bool = False
    needs_root = True  # a 0600 root file can only be read as root

    def command(self, sh: ShellCtx) -> str:
        p = sh.path(self.path)
        # A file whose content comes back is hashed on the control machine: each gather reads
        # several such files on every host, and every process spared here is spared 16 times.
        # sha256sum reads stdin: given a name, it escapes a name holding `\` by prefixing its line.
        small = (f'if [ "${{s##*|}}" -le {MAX_CONTENT} ]; then echo =; base64 < "$p"; else sha256sum < "$p"; fi'
                 if self.with_content else 'sha256sum < "$p"')
        return (f"p={p}\n"
                'if [ -e "$p" ] || [ -L "$p" ]; then\n'
                '  s=$(stat -c "%F|%a|%U|%G|%s" -- "$p") || exit 1; echo "$s"\n'
                f'  if [ -f "$p" ]; then {small}; else echo -; fi\n'
                "else echo absent; fi")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        lines = out.splitlines()
        if rc != 0 or not lines:
            raise FactError(err.strip() or f"stat failed (rc={rc})")
        if lines[0] == "absent":
            return {"exists": False}
        kind, mode, owner, group, size = lines[0].split("|")
        state: dict[str, Any] = {
            "exists": True,
            "type": {"regular file": "file", "regular empty file": "file", "directory": "directory",
                     "symbolic link": "link"}.get(kind, kind),
            "mode": int(mode, 8), "owner": owner, "group": group, "size": int(size),
            "sha256": None,
        }
        mark = lines[1] if len(lines) > 1 else "-"
        if mark == "=":
            state["content"] = base64.b64decode("".join(lines[2:]))
            state["sha256"] = hashlib.sha256(state["content"]).hexdigest()
        elif mark != "-":
            state["sha256"] = mark.split()[0]
        return state
