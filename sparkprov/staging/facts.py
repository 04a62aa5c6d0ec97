"""The store-state fact: everything a stage plan needs from one host, in one remote call."""

from __future__ import annotations

from dataclasses import dataclass

from sparkprov.facts.accounts import docker_reason
from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.staging.plan import STAGING, VERIFIED, Entry, StoreFacts, parse_mtime, parse_verified, repo_dir
from sparkprov.transport.shell import quote

TOOLS = ("rsync", "ssh", "sha256sum", "sha1sum", "docker")
DOWNLOADER_PREFIX = "sparkprov-stage-"


@dataclass(frozen=True)
class StoreState(Fact):
    """Sizes, mtimes and symlinks under the repos' cache folders, the staging area and plain
    destinations; the verified-state file; free space; tools; whether the client image is there."""

    store: str
    repos: tuple[str, ...]
    dests: tuple[str, ...] = ()
    image: str = ""

    def command(self, sh: ShellCtx) -> str:
        paths = [repo_dir(r) for r in self.repos] + [STAGING] + list(self.dests)
        lines = [
            f"S={sh.path(self.store)}",
            "printf 'store\\t%s\\n' \"$S\"",
            "printf 'ids\\t%s\\t%s\\t%s\\n' \"$(id -un)\" \"$(id -u)\" \"$(id -g)\"",
            'd=$S; while [ ! -d "$d" ]; do d=$(dirname "$d"); done',
            "printf 'free\\t%s\\n' \"$(df -P -B1 \"$d\" 2>/dev/null | awk 'NR==2{print $4}')\"",
            f"for t in {' '.join(TOOLS)}; do command -v $t >/dev/null 2>&1 && printf 'tool\\t%s\\n' $t; done",
            'if [ -d "$S" ]; then (cd "$S" && find ' + " ".join(quote(p) for p in paths)
            + " \\( -type f -o -type l \\) -printf 'e\\t%y\\t%s\\t%T@\\t%l\\t%p\\n' 2>/dev/null); fi",
            f'if [ -f "$S"/{quote(VERIFIED)} ]; then sed "s/^/v\\t/" "$S"/{quote(VERIFIED)}; fi',
        ]
        for r in self.repos:
            refs = f"{repo_dir(r)}/refs"
            lines.append(f'if [ -d "$S"/{quote(refs)} ]; then (cd "$S" && for f in $(find {quote(refs)} -type f); do '
                         "printf 'r\\t%s\\t%s\\n' \"$f\" \"$(head -c 100 \"$f\")\"; done); fi")
        if self.image:
            img = quote(self.image)
            lines.append(
                "if command -v docker >/dev/null 2>&1; then "
                f"if o=$(docker image inspect --format '{{{{.Id}}}}' {img} 2>&1); then printf 'image\\tpresent\\n'; "
                "else case \"$o\" in *'No such'*) printf 'image\\tabsent\\n';; "
                # every line of docker's answer (its reason is not always the first: `--format`
                # prints an empty line before it); the parse picks the reason
                "*) printf 'image\\terror\\t\\n'; printf '%s\\n' \"$o\" | sed -n '/[^[:space:]]/p' | head -n 8 "
                "| sed 's/^/imgerr\\t/';; esac; fi; "
                f"docker ps -q --filter name={DOWNLOADER_PREFIX} 2>/dev/null | sed 's/^/dl\\t/'; "
                "else printf 'image\\terror\\tdocker is not installed\\n'; fi")
        return "\n".join(lines)

    def parse(self, out: str, err: str, rc: int) -> StoreFacts:
        facts = StoreFacts(store="")
        verified_lines: list[str] = []
        errors: list[str] = []  # what docker answered when it could not look at the image
        for line in out.splitlines():
            tag, _, rest = line.partition("\t")
            if tag == "store":
                facts.store = rest
            elif tag == "ids":
                user, uid, gid = rest.split("\t")
                facts.user, facts.uid, facts.gid = user, int(uid), int(gid)
            elif tag == "free":
                facts.free = int(rest) if rest.strip().isdigit() else None
            elif tag == "tool":
                facts.tools.add(rest)
            elif tag == "e":
                kind, size, mtime, target, path = rest.split("\t", 4)
                facts.entries[path] = Entry(kind, int(size), parse_mtime(mtime), target)
            elif tag == "v":
                verified_lines.append(rest)
            elif tag == "r":
                path, _, value = rest.partition("\t")
                facts.refs[path] = value
            elif tag == "image":
                facts.image = rest.replace("\t", ": ", 1)
            elif tag == "imgerr":
                errors.append(rest)
            elif tag == "dl":
                facts.downloaders.append(rest)
        if errors and facts.image.startswith("error"):
            facts.image = "error: " + docker_reason("\n".join(errors))
        if not facts.store:
            raise FactError(f"store state unreadable: {err.strip() or out.strip()[:200]}")
        facts.verified = parse_verified("\n".join(verified_lines))
        return facts
