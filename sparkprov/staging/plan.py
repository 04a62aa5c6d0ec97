"""Planning a stage: pure functions over the hub's file list and each host's store facts.

Nothing here touches a host or the network; tests drive it with literal data.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from enum import Enum

STATE_DIR = ".sparkprov"
STAGING = f"{STATE_DIR}/staging"
VERIFIED = f"{STATE_DIR}/verified"
DISK_MARGIN = 512 * 1024 * 1024  # kept free on top of what a stage needs


def repo_dir(repo: str) -> str:
    """huggingface_hub's cache folder of a model repo, relative to HF_HOME."""
    return "hub/models--" + repo.replace("/", "--")


@dataclass(frozen=True)
class Item:
    """One file of the stage: a repo file at a commit and where it lands in the store."""

    repo: str
    revision: str
    commit: str
    path: str            # path in the repo
    size: int
    oid: str             # git blob id (what the hub's ETag is for small files)
    sha256: str | None   # LFS files: the content's sha256 (the hub's ETag for them)
    dest: str | None = None  # a plain file relative to the store (extra files, local_dir); None: HF cache

    @property
    def blob(self) -> str:
        return self.sha256 or self.oid

    @property
    def large(self) -> bool:
        return self.sha256 is not None

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else f"git:{self.oid}"

    @property
    def rel(self) -> str:
        """Where the content lives, relative to the store."""
        return self.dest or f"{repo_dir(self.repo)}/blobs/{self.blob}"

    @property
    def link(self) -> str | None:
        return None if self.dest else f"{repo_dir(self.repo)}/snapshots/{self.commit}/{self.path}"

    @property
    def link_target(self) -> str | None:
        """The relative symlink huggingface_hub makes: ../../blobs/BLOB (deeper for files in folders)."""
        if self.link is None:
            return None
        return posixpath.relpath(self.rel, posixpath.dirname(self.link))

    @property
    def staged(self) -> str:
        return f"{STAGING}/{self.rel}"


@dataclass(frozen=True)
class Entry:
    kind: str      # f (file) | l (symlink) | d ...
    size: int
    mtime_ns: int
    target: str    # symlink target ('' for files)


@dataclass(frozen=True)
class Record:
    """A line of the verified-state file: this path had this size, mtime and digest when hashed."""

    size: int
    mtime_ns: int
    digest: str


@dataclass
class StoreFacts:
    store: str                              # absolute path of the store on the host
    user: str = ""
    uid: int = 0
    gid: int = 0
    free: int | None = None                 # bytes free where the store is (or would be)
    entries: dict[str, Entry] = field(default_factory=dict)
    verified: dict[str, Record] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)   # rel path of a refs file -> its content
    tools: set[str] = field(default_factory=set)
    image: str | None = None                # present | absent | error: MSG | None (not asked)
    downloaders: list[str] = field(default_factory=list)  # leftover downloader containers


def parse_mtime(text: str) -> int:
    """`find -printf %T@` / Python's seconds.fraction -> integer nanoseconds."""
    sec, _, frac = text.strip().partition(".")
    return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])


def format_mtime(ns: int) -> str:
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def parse_verified(text: str) -> dict[str, Record]:
    """SIZE<TAB>MTIME<TAB>DIGEST<TAB>PATH lines; the last line for a path wins."""
    out: dict[str, Record] = {}
    for line in text.splitlines():
        parts = line.split("\t", 3)
        if len(parts) != 4:
            continue
        try:
            out[parts[3]] = Record(int(parts[0]), parse_mtime(parts[1]), parts[2])
        except ValueError:
            continue
    return out


class Status(str, Enum):
    OK = "ok"                  # published, and the record says it was verified as it is now
    UNVERIFIED = "unverified"  # published with the right size, not (or no longer) known good: hash it
    STAGED = "staged"          # complete in staging: hash it, then publish
    PARTIAL = "partial"        # part of it in staging: resume
    MISSING = "missing"
    WRONG = "wrong"            # published with the wrong size: remove, fetch again


@dataclass
class FileState:
    item: Item
    status: Status
    have: int = 0              # bytes on disk that a resume keeps (partial files)
    remove: list[str] = field(default_factory=list)  # paths to delete before fetching


@dataclass
class HostPlan:
    host: str
    files: dict[str, FileState]                     # rel -> state (one per distinct content path)
    links: list[Item] = field(default_factory=list)  # snapshot symlinks to (re)make
    refs: dict[str, str] = field(default_factory=dict)  # refs file rel -> commit to write
    free: int | None = None

    def with_status(self, *statuses: Status) -> list[FileState]:
        return [f for f in self.files.values() if f.status in statuses]

    @property
    def to_verify(self) -> list[FileState]:
        return self.with_status(Status.UNVERIFIED, Status.STAGED)

    @property
    def to_fetch(self) -> list[FileState]:
        return self.with_status(Status.PARTIAL, Status.MISSING, Status.WRONG)

    @property
    def need_bytes(self) -> int:
        """Bytes still to arrive (partial bytes kept), assuming files to verify are good."""
        return sum(f.item.size - f.have for f in self.to_fetch)

    @property
    def total_bytes(self) -> int:
        return sum(f.item.size for f in self.files.values())

    @property
    def complete(self) -> bool:
        return not self.to_verify and not self.to_fetch and not self.links and not self.refs

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for f in self.files.values():
            counts[f.status.value] = counts.get(f.status.value, 0) + 1
        parts = [f"{n} {s}" for s, n in sorted(counts.items())]
        return ", ".join(parts)


def plan_host(host: str, items: list[Item], facts: StoreFacts, *, rehash: bool = False) -> HostPlan:
    """What a host has of each item, and what it lacks. `rehash`: distrust the verified record."""
    files: dict[str, FileState] = {}
    for item in items:
        if item.rel in files:
            continue
        files[item.rel] = _file_state(item, facts, rehash)
    links = []
    for item in items:
        if item.link is None:
            continue
        e = facts.entries.get(item.link)
        if e is None or e.kind != "l" or e.target != item.link_target:
            links.append(item)
    refs = {}
    for item in items:
        if item.dest is None and item.revision != item.commit:
            ref = f"{repo_dir(item.repo)}/refs/{item.revision}"
            if facts.refs.get(ref, "").strip() != item.commit:
                refs[ref] = item.commit
    return HostPlan(host, files, links, refs, facts.free)


def _file_state(item: Item, facts: StoreFacts, rehash: bool = False) -> FileState:
    pub = facts.entries.get(item.rel)
    staged = facts.entries.get(item.staged)
    remove: list[str] = []
    if pub is not None and pub.kind == "f":
        if pub.size == item.size:
            rec = facts.verified.get(item.rel)
            if not rehash and rec and rec.size == pub.size and rec.mtime_ns == pub.mtime_ns and rec.digest == item.digest:
                return FileState(item, Status.OK)
            return FileState(item, Status.UNVERIFIED)
        remove.append(item.rel)
        status = Status.WRONG
    elif pub is not None:  # a symlink or directory where the content should be
        remove.append(item.rel)
        status = Status.WRONG
    else:
        status = Status.MISSING
    if staged is not None and staged.kind == "f":
        if staged.size == item.size and status is Status.MISSING:
            return FileState(item, Status.STAGED, have=staged.size)
        if staged.size < item.size:
            # an empty one (a receiver opened it and no byte came: a link cut first) holds nothing
            # to resume: missing, not partial
            partial = staged.size > 0 and status is Status.MISSING
            return FileState(item, Status.PARTIAL if partial else status, have=staged.size, remove=remove)
        remove.append(item.staged)
    elif staged is not None:
        remove.append(item.staged)
    return FileState(item, status, remove=remove)


@dataclass
class DiskProblem:
    host: str
    need: int
    free: int
    where: str

    def message(self) -> str:
        return (f"{self.host}: not enough space in {self.where}: the stage needs {human(self.need)} "
                f"(+{human(DISK_MARGIN)} kept free), {human(self.free)} free")


def check_disk(plan: HostPlan, store: str) -> DiskProblem | None:
    need = plan.need_bytes
    if need == 0 or plan.free is None:
        return None
    if plan.free < need + DISK_MARGIN:
        return DiskProblem(plan.host, need, plan.free, store)
    return None


def split_streams(items: list[Item], n: int) -> list[list[Item]]:
    """Up to n groups of about equal bytes (largest first onto the lightest group)."""
    n = max(1, min(n, len(items)))
    groups: list[list[Item]] = [[] for _ in range(n)]
    sizes = [0] * n
    for item in sorted(items, key=lambda i: (-i.size, i.rel)):
        k = sizes.index(min(sizes))
        groups[k].append(item)
        sizes[k] += item.size
    return [g for g in groups if g]


def streams_per_pair(pairs: int, streams: int) -> int:
    """Parallel rsync streams per (sender, receiver) pair so that the total stays within `streams`."""
    return max(1, streams // max(1, pairs))


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
