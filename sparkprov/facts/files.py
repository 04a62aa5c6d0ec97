"""Facts about paths: type, mode, owner, size, hash, and (for small files) content; a directory tree the
login user must own (OwnedTree: the model store, the compile cache)."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.transport.shell import quote

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


# ---------------------------------------------------------------------------------------------
# A tree the login user owns: the model store and the compile cache (G22, G23, G25)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OwnedTree(Fact):
    """A directory tree the login user must own: its state, what in it is owned by someone
    else (root-owned leftovers of container downloads, G23), free space of its filesystem, and
    its entry count and size in bytes."""

    path: str
    owner: str
    subdirs: tuple[str, ...] = ()
    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        p = sh.path(self.path)
        subs = "".join(f"  if [ -d \"$p\"/{quote(d)} ]; then echo sub={quote(d)}; fi\n" for d in self.subdirs)
        return (f"p={p}\n"
                "if [ -d \"$p\" ]; then\n"
                "  stat -c 'stat=%U|%G|%a' -- \"$p\"\n" + subs +
                # one walk for the count and the first five (a store holds thousands of files)
                f"  find \"$p\" -xdev ! -user {quote(self.owner)} -printf '%u %p\\n' 2>/dev/null | "
                "awk 'NR <= 5 {print \"foreign_path=\" $0} END {print \"foreign=\" NR}'\n"
                # entries by the shell's own globs (dot files too), size without a cut
                "  n=0; for e in \"$p\"/* \"$p\"/.[!.]* \"$p\"/..?*; do { [ -e \"$e\" ] || [ -L \"$e\" ]; } && n=$((n+1)); done\n"
                "  echo \"entries=$n\"; s=$(du -sb -- \"$p\" 2>/dev/null); echo \"size=${s%%[[:space:]]*}\"\n"
                "  d=\"$p\"\n"
                "elif [ -e \"$p\" ]; then echo notdir; d=$(dirname -- \"$p\")\n"
                "else echo absent; d=$(dirname -- \"$p\"); while [ ! -d \"$d\" ]; do d=$(dirname -- \"$d\"); done; fi\n"
                "df -P -B1 -- \"$d\" | awk 'NR==2 {print \"free=\" $4; print \"fs_total=\" $2; print \"mount=\" $6}'")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_owned_tree(out)


def parse_owned_tree(out: str) -> dict[str, Any]:
    lines = out.splitlines()
    state: dict[str, Any] = {"exists": False, "type": None, "foreign_count": 0, "foreign": [], "subdirs": []}
    for line in lines:
        if line.startswith("sub="):
            state["subdirs"].append(line[4:])
            continue
        if line == "absent":
            state["exists"] = False
        elif line == "notdir":
            state.update(exists=True, type="other")
        elif line.startswith("stat="):
            owner, group, mode = line[5:].split("|")
            state.update(exists=True, type="directory", owner=owner, group=group, mode=int(mode, 8))
        elif line.startswith("foreign="):
            state["foreign_count"] = int(line.split("=", 1)[1])
        elif line.startswith("foreign_path="):
            state["foreign"].append(line.split("=", 1)[1])
        elif line.startswith(("entries=", "size=", "free=", "fs_total=")):
            k, v = line.split("=", 1)
            state[k] = int(v) if v.strip() else None
        elif line.startswith("mount="):
            state["mount"] = line.split("=", 1)[1]
    return state
