"""The downloader that runs on the source host, inside the serving image (python3 with huggingface_hub).

It is sent as program text on the container's stdin (`python3 -`), its job appended as a JSON
literal; the token, when there is one, is read from a 0600 file mounted read-only. The bytes are
fetched by huggingface_hub's own downloader (`file_download.http_get`: its retries, Range
requests, redirects and hub error mapping), into a file sparkprov keeps across runs:

    STORE/.sparkprov/staging/REL   opened for append; `resume_size` = what is already there

huggingface_hub >= 1.18 downloads to a process-unique temporary file that it deletes when a
download fails, so a killed run loses everything; keeping our own staging file and handing
http_get the bytes already on disk makes an interrupted download resume on the next run. A file
is published (rename into blobs/ or its destination, then the snapshot symlink) only after its
sha256 (LFS) or git blob id (small files) matched the hub's.

This module is also importable (tests run `run_job` in-process against the lab hub).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

TOKEN_MOUNT = "/run/sparkprov/hf_token"
CHUNK = 1024 * 1024
_lock = threading.Lock()


def _hasher(large: bool, size: int):
    return hashlib.sha256() if large else hashlib.sha1(b"blob %d\0" % size)


def _hash_into(h, path: str, limit: int | None = None) -> None:
    left = limit
    with open(path, "rb") as fh:
        while left is None or left > 0:
            chunk = fh.read(8 * 1024 * 1024 if left is None else min(left, 8 * 1024 * 1024))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)


def _digest(path: str, large: bool, size: int) -> str:
    h = _hasher(large, size)
    _hash_into(h, path)
    return ("sha256:" if large else "git:") + h.hexdigest()


class _HashingFile:
    """The staging file as http_get writes to it, hashing each chunk on its way to disk (after the
    bytes a resumed download already had), so that a finished file is verified without reading
    it again: that read sat between one weight's download and the next, and at the end of the
    stage. http_get rewinds and truncates when a server ignores the Range header: then the
    running hash is void and the file is read again."""

    def __init__(self, fh, path: str, large: bool, size: int, have: int):
        self.fh, self.large = fh, large
        self.h = _hasher(large, size)
        self.void = False
        if have:
            _hash_into(self.h, path, have)

    def write(self, data: bytes) -> int:
        self.h.update(data)
        return self.fh.write(data)

    def tell(self) -> int:
        return self.fh.tell()

    def seek(self, *a):
        self.void = True
        return self.fh.seek(*a)

    def truncate(self, *a):
        self.void = True
        return self.fh.truncate(*a)

    def digest(self) -> str | None:
        return None if self.void else ("sha256:" if self.large else "git:") + self.h.hexdigest()


def _say(obj: dict) -> None:
    with _lock:
        sys.stdout.write("SPARKPROV-FETCH " + json.dumps(obj) + "\n")
        sys.stdout.flush()


def _publish(store: str, f: dict, staged: str) -> None:
    final = os.path.join(store, f["rel"])
    os.makedirs(os.path.dirname(final), exist_ok=True)
    os.replace(staged, final)
    if f.get("link"):
        link = os.path.join(store, f["link"])
        os.makedirs(os.path.dirname(link), exist_ok=True)
        tmp = f"{link}.sparkprov-{os.getpid()}"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.symlink(f["link_target"], tmp)
        os.replace(tmp, link)
    st = os.stat(final)
    ns = st.st_mtime_ns
    with _lock, open(os.path.join(store, ".sparkprov", "verified"), "a", encoding="utf-8") as fh:
        fh.write(f"{st.st_size}\t{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}\t{f['digest']}\t{f['rel']}\n")


def _one(job: dict, f: dict, headers: dict, received: threading.Event | None = None,
         started=None) -> dict:
    """Download one file, verify it and publish it. `started()` is called once its staging file
    is open (the fan-out streams it from there as it grows); `received` is set once its bytes
    are all on disk (before the fsync and the checks), so that the next weight can start."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get

    store = job["store"]
    staged = os.path.join(store, ".sparkprov", "staging", f["rel"])
    os.makedirs(os.path.dirname(staged), exist_ok=True)
    url = hf_hub_url(f["repo"], f["path"], revision=f["commit"], endpoint=job["endpoint"])
    resumed_from = 0
    for attempt in (1, 2):
        with open(staged, "ab") as fh:
            have = fh.tell()
            if have > f["size"]:
                fh.truncate(0)
                fh.seek(0)
                have = 0
            if attempt == 1:
                resumed_from = have
                if started is not None:
                    started()
            hashing = _HashingFile(fh, staged, f["large"], f["size"], have)
            try:
                http_get(url, hashing, resume_size=have, headers=dict(headers), expected_size=f["size"],
                         displayed_filename=f["path"])
            finally:
                if received is not None:
                    received.set()
            fh.flush()
            os.fsync(fh.fileno())
        got = hashing.digest() or _digest(staged, f["large"], f["size"])
        if got == f["digest"]:
            _publish(store, f, staged)
            return {"rel": f["rel"], "ok": True, "resumed_from": resumed_from, "attempts": attempt}
        # A wrong file (a corrupt partial from before, or bad bytes): drop it and fetch once more.
        os.unlink(staged)
    return {"rel": f["rel"], "ok": False, "error": f"digest mismatch after download: got {got}, want {f['digest']}"}


def _take_lock(store: str) -> int:
    """One downloader per store. A leftover one (its run was killed) is stopped: its partial files
    are what this one resumes from, and two appenders to one file would corrupt it."""
    fd = os.open(os.path.join(store, ".sparkprov", "fetch.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    for attempt in range(300):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == 0:
                try:
                    pid = int(os.pread(fd, 32, 0).decode().strip() or 0)
                    if pid > 1 and pid != os.getpid():
                        os.kill(pid, signal.SIGTERM)
                except (ValueError, ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.1)
    else:
        raise RuntimeError("another sparkprov download holds this store's lock")
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _watch(pid: int) -> None:
    """Exit when the run that started us is gone (killed): the next run resumes from disk."""
    def loop() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(70)
            except PermissionError:
                pass

    threading.Thread(target=loop, daemon=True).start()


def run_job(job: dict, token: str | None = None) -> dict:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    # http_get writes what it receives in DOWNLOAD_CHUNK_SIZE pieces (10 MiB): a killed run loses
    # at most one piece per file. 1 MiB keeps nearly everything and costs nothing in speed.
    if getattr(constants, "DOWNLOAD_CHUNK_SIZE", 0) > CHUNK:
        constants.DOWNLOAD_CHUNK_SIZE = CHUNK

    store = job["store"]
    os.makedirs(os.path.join(store, ".sparkprov"), exist_ok=True)
    lock_fd = _take_lock(store)
    if job.get("watch_pid"):
        _watch(int(job["watch_pid"]))
    headers = build_hf_headers(token=token or False)
    results: list[dict] = []
    t0 = time.monotonic()

    def say_fetching(f: dict) -> None:
        # the pipelined fan-out starts streaming this weight to the hosts that lack it
        with _lock:
            sys.stdout.write(f"SPARKPROV-FETCHING {int(f['n'])}\n")
            sys.stdout.flush()

    def run(f: dict, received: threading.Event | None = None) -> dict:
        streams = received is not None and "n" in f
        try:
            res = _one(job, f, headers, received, (lambda: say_fetching(f)) if streams else None)
        except Exception as exc:  # report per file; the control machine decides
            res = {"rel": f["rel"], "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        _say({"file": res})
        if res["ok"] and "n" in f:
            # the pipelined fan-out (staging/fanout.py) sends this file on now
            with _lock:
                sys.stdout.write(f"SPARKPROV-FETCHED {int(f['n'])}\n")
                sys.stdout.flush()
        return res

    with ThreadPoolExecutor(max_workers=max(1, int(job.get("workers", 4)))) as pool:
        if job.get("large_in_turn"):
            # Pipelined fan-out: the weights one after another, each at the whole link, so that each
            # is ready to go on to the other hosts while the next downloads (shards of one size
            # downloaded side by side would all finish at the end); the small files beside them.
            # The next weight starts as soon as the bytes of the one before are in: its fsync and
            # checks run beside it. Largest first: what lands last, and is sent last, is the
            # smallest weight (the last shard of a model is often a small one).
            futures = [pool.submit(run, f) for f in job["files"] if not f["large"]]
            with ThreadPoolExecutor(max_workers=2) as turn:
                for f in sorted((f for f in job["files"] if f["large"]), key=lambda f: -f["size"]):
                    received = threading.Event()
                    fut = turn.submit(run, f, received)
                    while not received.wait(0.05) and not fut.done():
                        pass
                    futures.append(fut)
                done = {r["rel"]: r for r in (fut.result() for fut in futures)}
            results = [done[f["rel"]] for f in job["files"]]
        else:
            results = list(pool.map(run, job["files"]))
    for ref, commit in job.get("refs", {}).items():
        path = os.path.join(store, ref)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(commit)
        os.replace(path + ".tmp", path)
    summary = {"ok": all(r["ok"] for r in results), "files": len(results), "seconds": round(time.monotonic() - t0, 3)}
    os.close(lock_fd)
    _say({"done": summary})
    return {"summary": summary, "results": results}


def main(job: dict) -> int:
    token = None
    path = os.environ.get("SPARKPROV_TOKEN_FILE") or TOKEN_MOUNT
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip() or None
    out = run_job(job, token)
    return 0 if out["summary"]["ok"] else 3


def program(job: dict) -> str:
    """This module's source with a call to main(job): what the container runs from stdin."""
    with open(__file__, encoding="utf-8") as fh:
        src = fh.read()
    return src + f"\n\nif __name__ == '__main__':\n    sys.exit(main(json.loads({json.dumps(json.dumps(job))})))\n"
