"""Facts `invoke monitor up|down` reads on the Prometheus host: the files it keeps there."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx

_LINE = re.compile(r"^([0-7]{3,4}) ([0-9a-f]{64}) (.+)$")


def parse_tree(out: str) -> dict[str, Any]:
    """`exists` (the folder is there), `files`: path relative to `files_under` -> (mode, sha256)."""
    lines = out.splitlines()
    if not lines or lines[0] not in ("@absent", "@present"):
        raise FactError(f"unexpected output: {out.strip()[:200]!r}")
    files: dict[str, tuple[int, str]] = {}
    for line in lines[1:]:
        m = _LINE.match(line)
        if not m:
            raise FactError(f"unexpected line: {line[:200]!r}")
        files[m.group(3)] = (int(m.group(1), 8), m.group(2))
    return {"exists": lines[0] == "@present", "files": files}


@dataclass(frozen=True)
class FileTree(Fact):
    """Whether the folder `path` exists, and every regular file under `path`/`files_under` with its
    mode and sha256 (a digest, never the content: the API keys live there)."""

    path: str
    files_under: str

    def command(self, sh: ShellCtx) -> str:
        top = sh.path(self.path)
        return (f"t={top}\n"
                'if [ ! -d "$t" ]; then echo @absent; exit 0; fi\necho @present\n'
                f'cd "$t"/{sh.path(self.files_under)} 2>/dev/null || exit 0\n'
                "find . -type f | sort | while IFS= read -r f; do\n"
                '  printf \'%s %s %s\\n\' "$(stat -c %a -- "$f")" "$(sha256sum < "$f" | cut -c1-64)" "${f#./}"\n'
                "done")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        if rc != 0:
            raise FactError(err.strip() or f"reading the files failed (rc={rc})")
        return parse_tree(out)
