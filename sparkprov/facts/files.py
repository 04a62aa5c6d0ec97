"""Facts about paths: type, mode, owner, size, hash, and (for small files) content."""

from __future__ import annotations

import base64
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
        content = (f'if [ -f "$p" ] && [ "$(stat -c %s -- "$p")" -le {MAX_CONTENT} ]; then base64 < "$p"; fi'
                   if self.with_content else ":")
        return (f"p={p}\n"
                'if [ -e "$p" ] || [ -L "$p" ]; then\n'
                '  stat -c "%F|%a|%U|%G|%s" -- "$p" || exit 1\n'
                # on stdin: with a file name, sha256sum escapes a name holding `\` by prefixing its line with `\`
                '  if [ -f "$p" ]; then sha256sum < "$p" | cut -d" " -f1; else echo -; fi\n'
                f"  {content}\n"
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
            "sha256": lines[1] if len(lines) > 1 and lines[1] != "-" else None,
        }
        if self.with_content and len(lines) > 2:
            state["content"] = base64.b64decode("".join(lines[2:]))
        return state
