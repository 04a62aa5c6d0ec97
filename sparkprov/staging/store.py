"""The store as users manage it (`invoke store`): what a host's store holds, and what pruning removes.

    StoreContents   the fact: one script reads every hub/models--*/ repo of the store (refs, snapshot
                    files and links, blobs with size and mtime), sparkprov's verified record, the
                    staging leftovers, the compile cache's size, whether docker is installed
    parse_contents  its pure parser (tests feed it literal output)
    summarize       per repo and revision: size, files, verified files, blobs
    removal_*       pure: what pruning a whole repo or some of its revisions removes (a blob that a
                    kept snapshot links to stays), and the one script that removes it

A blob counts as verified when sparkprov's record (.sparkprov/verified, written by verify.py after
the digest matched the hub's) names it with its current size and mtime and a digest equal to the
blob's own name (huggingface_hub names blobs by sha256 or git blob id).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.staging.plan import STAGING, VERIFIED, Record, parse_mtime, parse_verified
from sparkprov.transport.shell import quote

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
COMMIT = re.compile(r"[0-9a-f]{40}")


def valid_repo_id(repo: str) -> bool:
    """ORG/NAME as the hub names repos (no '--' or '..': they would make the cache folder ambiguous)."""
    return bool(REPO_ID.fullmatch(repo)) and "--" not in repo and ".." not in repo and len(repo) <= 96


def repo_of_dir(name: str) -> str:
    """models--ORG--NAME -> ORG/NAME (huggingface_hub's own convention)."""
    return name.removeprefix("models--").replace("--", "/")


@dataclass(frozen=True)
class Blob:
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class SnapFile:
    blob: str | None   # the blob a link points at (None: a regular file in the snapshot)
    size: int          # a regular file's size (links: 0; their size is the blob's)
    mtime_ns: int = 0


@dataclass
class RepoContents:
    repo: str
    dir: str                                               # hub/models--ORG--NAME
    refs: dict[str, str] = field(default_factory=dict)     # ref name (main, refs/pr/1 -> pr/1) -> commit
    snapshots: dict[str, dict[str, SnapFile]] = field(default_factory=dict)  # commit -> repo path -> file
    blobs: dict[str, Blob] = field(default_factory=dict)   # blob name -> size, mtime
    staged: bool = False                                   # leftovers under .sparkprov/staging


@dataclass
class StoreContents:
    store: str
    exists: bool = False
    repos: dict[str, RepoContents] = field(default_factory=dict)  # repo id -> contents
    verified: dict[str, Record] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)            # path, exists, entries, size
    docker: bool = False                                           # the docker client is installed


@dataclass(frozen=True)
class StoreContentsFact(Fact):
    """Every repo of a host's store and its compile cache, in one script."""

    store: str
    compile_cache: str

    def command(self, sh: ShellCtx) -> str:
        return "\n".join([
            f"S={sh.path(self.store)}",
            f"C={sh.path(self.compile_cache)}",
            "printf 'store\\t%s\\n' \"$S\"",
            "if command -v docker >/dev/null 2>&1; then printf 'docker\\tyes\\n'; fi",
            'if [ -d "$S/hub" ]; then (cd "$S" && '
            "find hub -mindepth 1 -maxdepth 1 -type d -name 'models--*' -printf 'repo\\t%f\\n' && "
            "find hub -mindepth 3 -path 'hub/models--*/*' \\( -type f -o -type l \\) "
            "-printf 'e\\t%y\\t%s\\t%T@\\t%l\\t%p\\n' 2>/dev/null; "
            "find hub -mindepth 3 -path 'hub/models--*/refs/*' -type f 2>/dev/null | while IFS= read -r f; do "
            "printf 'r\\t%s\\t%s\\n' \"$f\" \"$(head -c 100 \"$f\")\"; done); fi",
            f'if [ -d "$S"/{quote(STAGING)}/hub ]; then (cd "$S"/{quote(STAGING)} && '
            "find hub -mindepth 1 -maxdepth 1 -name 'models--*' -printf 'staged\\t%f\\n'); fi",
            f'if [ -f "$S"/{quote(VERIFIED)} ]; then sed "s/^/v\\t/" "$S"/{quote(VERIFIED)}; fi',
            'if [ -d "$C" ]; then printf \'cache\\t%s\\t%s\\t%s\\n\' "$C" '
            '"$(find "$C" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)" "$(du -sb -- "$C" 2>/dev/null | cut -f1)"; '
            "else printf 'cache\\t%s\\tabsent\\n' \"$C\"; fi",
        ])

    def parse(self, out: str, err: str, rc: int) -> StoreContents:
        return parse_contents(out, err)


def parse_contents(out: str, err: str = "") -> StoreContents:
    """The fact's output -> StoreContents. Lines that do not parse (a file name with a tab) are skipped."""
    sc = StoreContents(store="")
    verified: list[str] = []

    def repo(dirname: str) -> RepoContents:
        rid = repo_of_dir(dirname)
        return sc.repos.setdefault(rid, RepoContents(rid, f"hub/{dirname}"))

    for line in out.splitlines():
        tag, _, rest = line.partition("\t")
        if tag == "store":
            sc.store = rest
        elif tag == "docker":
            sc.docker = True
        elif tag == "repo":
            sc.exists = True
            repo(rest)
        elif tag == "e":
            parts = rest.split("\t", 4)
            if len(parts) != 5:
                continue
            kind, size, mtime, target, path = parts
            bits = path.split("/")
            if len(bits) < 4 or bits[0] != "hub" or not bits[1].startswith("models--"):
                continue
            try:
                size_n, mtime_ns = int(size), parse_mtime(mtime)
            except ValueError:
                continue
            rc = repo(bits[1])
            if bits[2] == "blobs" and len(bits) == 4 and kind == "f":
                rc.blobs[bits[3]] = Blob(size_n, mtime_ns)
            elif bits[2] == "snapshots" and len(bits) >= 5:
                rel = "/".join(bits[4:])
                snap = rc.snapshots.setdefault(bits[3], {})
                if kind == "l":  # huggingface_hub's ../../blobs/BLOB (a link elsewhere: a file of no known blob)
                    snap[rel] = SnapFile(posixpath.basename(target) if "blobs/" in target else None, 0)
                else:
                    snap[rel] = SnapFile(None, size_n, mtime_ns)
        elif tag == "r":
            path, _, value = rest.partition("\t")
            bits = path.split("/")
            if len(bits) >= 4 and bits[2] == "refs":
                repo(bits[1]).refs["/".join(bits[3:])] = value.strip()
        elif tag == "staged":
            sc.exists = True
            repo(rest).staged = True
        elif tag == "v":
            verified.append(rest)
        elif tag == "cache":
            parts = rest.split("\t")
            if len(parts) == 2 and parts[1] == "absent":
                sc.cache = {"path": parts[0], "exists": False, "entries": 0, "size": 0}
            elif len(parts) == 3:
                sc.cache = {"path": parts[0], "exists": True, "entries": _int(parts[1]), "size": _int(parts[2])}
    if not sc.store:
        raise FactError(f"store unreadable: {err.strip() or out.strip()[:200]}")
    sc.verified = parse_verified("\n".join(verified))
    return sc


def _int(text: str) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else 0


# -- what the store holds --------------------------------------------------------------------

def blob_verified(sc: StoreContents, rc: RepoContents, name: str) -> bool:
    blob = rc.blobs.get(name)
    rec = sc.verified.get(f"{rc.dir}/blobs/{name}")
    return (blob is not None and rec is not None and rec.size == blob.size and rec.mtime_ns == blob.mtime_ns
            and rec.digest.partition(":")[2] == name)


def _file_verified(sc: StoreContents, rc: RepoContents, commit: str, path: str, f: SnapFile) -> bool:
    if f.blob is not None:
        return blob_verified(sc, rc, f.blob)
    rec = sc.verified.get(f"{rc.dir}/snapshots/{commit}/{path}")
    return rec is not None and rec.size == f.size and rec.mtime_ns == f.mtime_ns


def revision_size(rc: RepoContents, commit: str) -> int:
    """Bytes a snapshot holds: its links' blobs (each once) and its regular files."""
    files = rc.snapshots.get(commit, {})
    blobs = {f.blob for f in files.values() if f.blob}
    return sum(rc.blobs[b].size for b in blobs if b in rc.blobs) + sum(f.size for f in files.values() if f.blob is None)


def repo_size(rc: RepoContents) -> int:
    return (sum(b.size for b in rc.blobs.values())
            + sum(f.size for files in rc.snapshots.values() for f in files.values() if f.blob is None))


def summarize(sc: StoreContents, rc: RepoContents) -> dict[str, Any]:
    """A repo as `invoke store` shows it: size, blobs verified, and each revision (commit, the refs
    naming it, files, files verified, files whose blob is missing, size)."""
    revisions = []
    names: dict[str, list[str]] = {}
    for ref, commit in rc.refs.items():
        names.setdefault(commit, []).append(ref)
    for commit in sorted(rc.snapshots, key=lambda c: (not names.get(c), sorted(names.get(c, [])), c)):
        files = rc.snapshots[commit]
        revisions.append({
            "commit": commit, "refs": sorted(names.get(commit, [])), "files": len(files),
            "verified": sum(1 for p, f in files.items() if _file_verified(sc, rc, commit, p, f)),
            "missing": sum(1 for f in files.values() if f.blob is not None and f.blob not in rc.blobs),
            "size": revision_size(rc, commit)})
    dangling_refs = sorted(r for r, c in rc.refs.items() if c not in rc.snapshots)
    return {"repo": rc.repo, "dir": rc.dir, "size": repo_size(rc), "blobs": len(rc.blobs),
            "blobs_verified": sum(1 for b in rc.blobs if blob_verified(sc, rc, b)),
            "revisions": revisions, "refs_without_snapshot": dangling_refs, "staging_leftovers": rc.staged}


# -- what pruning removes -------------------------------------------------------------------

@dataclass
class Removal:
    repo: str
    whole: bool
    paths: list[str]                                   # relative to the store
    commits: list[str] = field(default_factory=list)   # snapshots removed (whole: all of them)
    bytes: int = 0

    def describe(self) -> str:
        if self.whole:
            return self.repo
        return f"{self.repo}: {len(self.commits)} unused revision{'s' * (len(self.commits) != 1)}"


def removal_whole(rc: RepoContents) -> Removal:
    paths = []
    if rc.blobs or rc.snapshots or rc.refs or not rc.staged:
        paths.append(rc.dir)
    if rc.staged:
        paths.append(f"{STAGING}/{rc.dir}")
    return Removal(rc.repo, True, paths, sorted(rc.snapshots), repo_size(rc))


def removal_revisions(rc: RepoContents, keep: set[str]) -> Removal | None:
    """The snapshots whose commit is not in `keep`, the refs naming them, and the blobs only they
    link to (a blob a kept snapshot links to stays; a blob no snapshot links to is left alone)."""
    gone = sorted(c for c in rc.snapshots if c not in keep)
    if not gone:
        return None
    kept_blobs = {f.blob for c, files in rc.snapshots.items() if c not in gone for f in files.values() if f.blob}
    gone_blobs = sorted({f.blob for c in gone for f in rc.snapshots[c].values()
                         if f.blob and f.blob not in kept_blobs and f.blob in rc.blobs})
    refs = sorted(r for r, c in rc.refs.items() if c in gone)
    paths = ([f"{rc.dir}/snapshots/{c}" for c in gone] + [f"{rc.dir}/refs/{r}" for r in refs]
             + [f"{rc.dir}/blobs/{b}" for b in gone_blobs])
    size = (sum(rc.blobs[b].size for b in gone_blobs)
            + sum(f.size for c in gone for f in rc.snapshots[c].values() if f.blob is None))
    return Removal(rc.repo, False, paths, gone, size)


def _safe(rel: str) -> str:
    parts = rel.split("/")
    if (not (rel.startswith("hub/models--") or rel.startswith(f"{STAGING}/hub/models--")) or ".." in parts
            or "" in parts or "." in parts or any(c in rel for c in "\n\t\0|")):
        raise ValueError(f"refusing to remove {rel!r}: not a path inside the store's hub")
    return rel


def removal_script(store_abs: str, removals: list[Removal]) -> str:
    """rm -rf each path (relative to the store), then drop the verified record's lines for them."""
    paths = [_safe(p) for r in removals for p in r.paths]
    if not paths:
        return ":"
    drop = "|".join(p if p.rsplit("/", 2)[-2] == "blobs" else p + "/" for p in paths)
    return "\n".join([
        "set -eu",
        f"S={quote(store_abs)}",
        'cd "$S"',
        "rm -rf -- " + " ".join(quote(p) for p in paths),
        f'V={quote(VERIFIED)}',
        'if [ -f "$V" ]; then awk -F "\\t" -v drop=' + quote(drop) + " 'BEGIN {n = split(drop, d, \"|\")} "
        "{for (i = 1; i <= n; i++) if ($4 == d[i] || index($4, d[i]) == 1 && substr(d[i], length(d[i])) == \"/\") next; "
        "print}' \"$V\" > \"$V.sp$$\" && mv -f \"$V.sp$$\" \"$V\"; fi",
    ]) + "\n"

