"""Shell for a host's store: hash files, publish the good ones atomically, record verified state.

One script per host and step; every path and digest is quoted into it (shell.cmd). Output lines:

    R<TAB>REL<TAB>ok|bad<TAB>DIGEST-FOUND     R<TAB>REL<TAB>partial<TAB>BYTES-ON-DISK

A published file that hashes wrong is removed (its snapshot link then dangles until the file is
fetched again in the same run); a staged file that hashes wrong is removed; a staged file shorter
than its size (a transfer cut mid-way) is kept as it is, for the next run to resume. A good staged file is
renamed into place, then its snapshot symlink is made (tmp link + rename), then its size, mtime and
digest are appended to the verified-state file, which later runs trust while size and mtime hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkprov.staging.plan import STAGING, VERIFIED, Item
from sparkprov.transport.shell import cmd, quote

FUNCS = r"""__sp_digest() { # path size large (openssl's sha256 uses the CPU's SHA instructions: 3-4x sha256sum)
  if [ "$3" = 1 ] && command -v openssl >/dev/null 2>&1; then printf 'sha256:%s' "$(openssl dgst -sha256 -r < "$1" | cut -c1-64)"
  elif [ "$3" = 1 ]; then printf 'sha256:%s' "$(sha256sum < "$1" | cut -c1-64)"
  else printf 'git:%s' "$( { printf 'blob %s\000' "$2"; cat "$1"; } | sha1sum | cut -c1-40)"; fi
}
__sp_link() { # link target
  mkdir -p "$(dirname "$1")" && ln -sfn "$2" "$1.sp$$" && mv -fT "$1.sp$$" "$1"
}
__sp_record() { # path size digest rel
  printf '%s\t%s\t%s\t%s\n' "$2" "$(find "$1" -maxdepth 0 -printf '%T@')" "$3" "$4" >> "$S/.sparkprov/verified"
}
__sp_check() { # mode rel size large digest link target
  if [ "$1" = staged ]; then f="$S/.sparkprov/staging/$2"; else f="$S/$2"; fi
  if [ "$1" = staged ]; then
    have=$(stat -c %s "$f" 2>/dev/null || echo 0)
    if [ "$have" -lt "$3" ]; then printf 'R\t%s\tpartial\t%s\n' "$2" "$have"; return 0; fi
  fi
  got=$(__sp_digest "$f" "$3" "$4")
  if [ "$got" = "$5" ]; then
    if [ "$1" = staged ]; then mkdir -p "$(dirname "$S/$2")" && mv -f "$f" "$S/$2" || return 1; fi
    if [ -n "$6" ]; then __sp_link "$S/$6" "$7" || return 1; fi
    __sp_record "$S/$2" "$3" "$5" "$2"
    printf 'R\t%s\tok\t%s\n' "$2" "$got"
  else
    rm -f "$f"
    printf 'R\t%s\tbad\t%s\n' "$2" "$got"
  fi
}
"""


@dataclass(frozen=True)
class Check:
    mode: str  # published | staged
    item: Item


def script(store_abs: str, checks: list[Check], *, links: list[Item] = (), refs: dict[str, str] | None = None,
           remove: list[str] = (), parallel: int = 4) -> str:
    """Hash and publish `checks`, make `links`, write `refs`, delete `remove` (paths relative to the store)."""
    lines = ["set -u", f"S={quote(store_abs)}", 'mkdir -p "$S/.sparkprov"', FUNCS]
    for rel in remove:
        lines.append(f'rm -f "$S"/{quote(rel)}')
    n = 0
    for c in checks:
        i = c.item
        lines.append(cmd("__sp_check", c.mode, i.rel, i.size, int(i.large), i.digest, i.link or "",
                         i.link_target or "") + " &")
        n += 1
        if n % max(1, parallel) == 0:
            lines.append("wait")
    lines.append("wait")
    for i in links:
        lines.append(f'[ -f "$S"/{quote(i.rel)} ] && __sp_link "$S"/{quote(i.link)} {quote(i.link_target)} '
                     f"&& printf 'L\\t%s\\n' {quote(i.link)}")
    for ref, commit in (refs or {}).items():
        lines.append(f'mkdir -p "$(dirname "$S"/{quote(ref)})" && printf %s {quote(commit)} > "$S"/{quote(ref)}.sp$$ '
                     f'&& mv -f "$S"/{quote(ref)}.sp$$ "$S"/{quote(ref)}')
    # Compact the record: the last line of a path wins.
    lines.append('if [ -f "$S/.sparkprov/verified" ]; then awk -F "\\t" \'{k[$4]=$0} END {for (p in k) print k[p]}\' '
                 '"$S/.sparkprov/verified" > "$S/.sparkprov/verified.sp$$" && mv -f "$S/.sparkprov/verified.sp$$" '
                 '"$S/.sparkprov/verified"; fi')
    return "\n".join(lines) + "\n"


def parse(out: str) -> dict[str, tuple[bool, str]]:
    """rel -> (good, digest found); a staged file cut short: (False, "partial: BYTES")"""
    res: dict[str, tuple[bool, str]] = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 4 and parts[0] == "R":
            res[parts[1]] = (parts[2] == "ok", f"partial: {parts[3]}" if parts[2] == "partial" else parts[3])
    return res


assert STAGING == ".sparkprov/staging" and VERIFIED == ".sparkprov/verified"  # the shell above spells them out
