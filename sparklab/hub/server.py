"""An HTTP server speaking the Hugging Face Hub protocol that huggingface_hub uses to download models.

Endpoints (model repos; `{rev}` is `main` or the repo's commit id, percent-encoded as the client sends it):

    GET  /api/models/{repo}                      model info (ModelInfo JSON; ?blobs=true adds file sizes/lfs)
    GET  /api/models/{repo}/revision/{rev}       same, at a revision (what snapshot_download calls first)
    GET  /api/models/{repo}/tree/{rev}[/{path}]  tree listing, ?recursive=true&expand=true, paginated with
                                                 `Link: <...cursor=...>; rel="next"` (1000 entries, 50 expanded)
    POST /api/models/{repo}/paths-info/{rev}     paths info (form or JSON: paths=..., expand=...)
    GET  /api/models/{repo}/refs                 branches / tags
    GET  /api/models/{repo}/commits/{rev}        commit list (one commit)
    GET  /api/whoami-v2                          the lab user (needs the lab token)
    HEAD /{repo}/resolve/{rev}/{path}            X-Repo-Commit, ETag (git blob id) or, for LFS files,
    GET  /{repo}/resolve/{rev}/{path}            ETag/X-Linked-Etag = sha256, X-Linked-Size, Content-Length,
                                                 Accept-Ranges; GET honours `Range: bytes=a-b` (206,
                                                 Content-Range) and answers 416 when unsatisfiable.

Files are served directly (200), without the Hub's redirect to a CDN; the client handles both.
Errors carry the Hub's `X-Error-Code` / `X-Error-Message` headers (RepoNotFound, RevisionNotFound,
EntryNotFound, GatedRepo), which huggingface_hub maps to its exception classes.

Gated repos: metadata is public (as on the Hub); file HEAD/GET answer 401 GatedRepo without a token. Any
request carrying a Bearer token that is not the lab token gets 401 "Invalid credentials in Authorization
header", as on the Hub.

Lab control API (only from loopback or from the server's own address, i.e. the control machine, never from
a simulated Spark):

    GET  /_lab/health     {"ok", "pid", "repos": {repo: commit}}
    GET  /_lab/control    the current settings
    POST /_lab/control    JSON, any of:
        throttle_bps: int | null           global bytes/s limit over all connections (token bucket)
        drop: {after_bytes, count, path_glob} | null
                                           close the connection after `after_bytes` bytes of a file body
                                           (count: how many responses to cut, null = until cleared)
        drop_after_bytes: int | null       shorthand for drop: {after_bytes: N} (every file body)
        fail_next: {path_glob, status, count, method} | [..]
                                           answer `status` to the next `count` matching requests
        clear_faults: true                 remove drop and fail rules
        require_token: bool                treat every repo as gated
        gated: {repo_id: bool}             gate / ungate repos at run time
    GET  /_lab/requests   the request log: [{seq, method, path, range, status, bytes_sent, auth, dropped,
                          fault, client, duration_s}]  (`auth` is whether Authorization was sent; the
                          token itself is never stored)
    DELETE /_lab/requests clear the log
"""

from __future__ import annotations

import base64
import datetime as _dt
import fnmatch
import hashlib
import hmac
import ipaddress
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .repos import GeneratedRepo, RepoFile

LAB_NETWORK = ipaddress.ip_network("10.77.0.0/24")
TREE_PAGE_SIZE = 1000
TREE_PAGE_SIZE_EXPANDED = 50
REQUEST_LOG_MAX = 20000
COMMIT_DATE = "2025-01-01T00:00:00.000Z"


def check_bind_address(ip: str) -> str:
    """Only loopback or the lab bridge network: never any other address (nor 0.0.0.0)."""
    addr = ipaddress.ip_address(ip)
    if addr.version != 4 or not (addr.is_loopback or addr in LAB_NETWORK):
        raise ValueError(f"refusing to bind {ip}: only 127.0.0.0/8 or {LAB_NETWORK} (the lab bridge)")
    return ip


class Throttle:
    """Global byte-rate limit (GCRA token bucket): every body chunk of every connection takes from it."""

    BURST_S = 0.05

    def __init__(self, bps: int | None = None):
        self._lock = threading.Lock()
        self._bps: int | None = None
        self._tat = 0.0
        self.set(bps)

    @property
    def bps(self) -> int | None:
        return self._bps

    def set(self, bps: int | None) -> None:
        if bps is not None and (not isinstance(bps, int) or isinstance(bps, bool) or bps < 0):
            raise ValueError("throttle_bps must be a non-negative integer or null")
        with self._lock:
            self._bps = bps or None
            self._tat = time.monotonic()

    def chunk_size(self) -> int:
        bps = self._bps
        return 256 * 1024 if not bps else max(1024, min(256 * 1024, bps // 20))

    def take(self, n: int) -> None:
        with self._lock:
            bps = self._bps
            if not bps:
                return
            now = time.monotonic()
            start = max(self._tat, now)
            self._tat = start + n / bps
            delay = start - now - self.BURST_S
        if delay > 0:
            time.sleep(delay)


@dataclass
class FailRule:
    path_glob: str
    status: int
    count: int | None  # None = until cleared
    method: str | None

    def to_json(self) -> dict:
        return {"path_glob": self.path_glob, "status": self.status, "count": self.count, "method": self.method}


@dataclass
class DropRule:
    after_bytes: int
    count: int | None
    path_glob: str

    def to_json(self) -> dict:
        return {"after_bytes": self.after_bytes, "count": self.count, "path_glob": self.path_glob}


class HubState:
    def __init__(self, repos: list[GeneratedRepo], token: str | None = None, throttle_bps: int | None = None):
        self.repos: dict[str, GeneratedRepo] = {r.repo_id: r for r in repos}
        self._token = token.encode() if token else None
        self.lock = threading.Lock()
        self.throttle = Throttle(throttle_bps)
        self.fail_rules: list[FailRule] = []
        self.drop: DropRule | None = None
        self.require_token = False
        self.gated: dict[str, bool] = {r.repo_id: r.spec.gated for r in repos}
        self.log: list[dict] = []
        self.seq = 0

    # -- auth
    def token_matches(self, presented: str) -> bool:
        return self._token is not None and hmac.compare_digest(presented.encode(), self._token)

    # -- faults
    def take_fail(self, method: str, path: str) -> int | None:
        with self.lock:
            for rule in self.fail_rules:
                if rule.method and rule.method.upper() != method:
                    continue
                if not fnmatch.fnmatchcase(path, rule.path_glob):
                    continue
                if rule.count is not None:
                    rule.count -= 1
                    if rule.count <= 0:
                        self.fail_rules.remove(rule)
                return rule.status
        return None

    def take_drop(self, path: str, length: int) -> int | None:
        with self.lock:
            d = self.drop
            if d is None or length <= d.after_bytes or not fnmatch.fnmatchcase(path, d.path_glob):
                return None
            if d.count is not None:
                d.count -= 1
                if d.count <= 0:
                    self.drop = None
            return d.after_bytes

    def control(self, body: dict) -> dict:
        known = {"throttle_bps", "drop", "drop_after_bytes", "fail_next", "clear_faults", "require_token", "gated"}
        unknown = set(body) - known
        if unknown:
            raise ValueError(f"unknown control keys {sorted(unknown)} (known: {sorted(known)})")
        with self.lock:
            if body.get("clear_faults"):
                self.fail_rules.clear()
                self.drop = None
            if "throttle_bps" in body:
                self.throttle.set(body["throttle_bps"])
            if "drop_after_bytes" in body:
                n = body["drop_after_bytes"]
                self.drop = None if n is None else DropRule(_nonneg_int(n, "drop_after_bytes"), None, "*")
            if "drop" in body:
                d = body["drop"]
                if d is None:
                    self.drop = None
                else:
                    extra = set(d) - {"after_bytes", "count", "path_glob"}
                    if extra:
                        raise ValueError(f"unknown drop keys {sorted(extra)}")
                    count = d.get("count")
                    self.drop = DropRule(
                        _nonneg_int(d["after_bytes"], "drop.after_bytes"),
                        None if count is None else _nonneg_int(count, "drop.count") or None,
                        str(d.get("path_glob") or "*"),
                    )
            if "fail_next" in body:
                rules = body["fail_next"]
                for r in rules if isinstance(rules, list) else [rules]:
                    extra = set(r) - {"path_glob", "status", "count", "method"}
                    if extra:
                        raise ValueError(f"unknown fail_next keys {sorted(extra)}")
                    status = int(r.get("status", 500))
                    if not 400 <= status <= 599:
                        raise ValueError("fail_next.status must be 4xx or 5xx")
                    count = r.get("count", 1)
                    self.fail_rules.append(FailRule(
                        str(r.get("path_glob") or "*"), status,
                        None if count is None else _nonneg_int(count, "fail_next.count") or 1,
                        r.get("method"),
                    ))
            if "require_token" in body:
                self.require_token = bool(body["require_token"])
            if "gated" in body:
                for repo_id, flag in dict(body["gated"]).items():
                    if repo_id not in self.repos:
                        raise ValueError(f"unknown repo {repo_id!r}")
                    self.gated[repo_id] = bool(flag)
        return self.settings()

    def settings(self) -> dict:
        return {
            "throttle_bps": self.throttle.bps,
            "drop": self.drop.to_json() if self.drop else None,
            "fail_next": [r.to_json() for r in self.fail_rules],
            "require_token": self.require_token,
            "gated": dict(self.gated),
            "token_configured": self._token is not None,
        }

    def record(self, entry: dict) -> None:
        with self.lock:
            self.seq += 1
            entry["seq"] = self.seq
            self.log.append(entry)
            if len(self.log) > REQUEST_LOG_MAX:
                del self.log[: len(self.log) - REQUEST_LOG_MAX]

    def is_gated(self, repo_id: str) -> bool:
        return self.require_token or self.gated.get(repo_id, False)


def _nonneg_int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{what} must be a non-negative integer")
    return v


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def _truthy(v: str | None) -> bool:
    return v is not None and v.lower() in ("1", "true", "yes")


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sparkprov-lab-hub/1"
    server: "HubServer"

    # ----------------------------------------------------------------- plumbing
    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        # One line per request to the server log (stderr); no header values, so no token.
        self.server.log_line("%s %s" % (self.client_address[0], format % args))

    @property
    def state(self) -> HubState:
        return self.server.state

    def _handle(self, method: str) -> None:
        t0 = time.monotonic()
        split = urlsplit(self.path)
        self._raw_path = split.path
        self._query = parse_qs(split.query, keep_blank_values=True)
        self._status = 0
        self._sent = 0
        self._dropped = False
        self._fault = False
        self._body_read = False
        is_lab = self._raw_path.startswith("/_lab/")
        try:
            try:
                if is_lab:
                    self._lab(method)
                else:
                    status = self.state.take_fail(method, unquote(self._raw_path))
                    if status is not None:
                        self._fault = True
                        raise HubError(status, "lab fault injected")
                    self._route(method)
            except HubError as e:
                self._send_error(e)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        finally:
            if not self._body_read and int(self.headers.get("Content-Length") or 0) > 0:
                self.close_connection = True  # an unread request body would be parsed as the next request
            if not is_lab:
                self.state.record({
                    "time": time.time(),
                    "client": self.client_address[0],
                    "method": method,
                    "path": self.path,
                    "range": self.headers.get("Range"),
                    "status": self._status,
                    "bytes_sent": self._sent,
                    "auth": self.headers.get("Authorization") is not None,
                    "dropped": self._dropped,
                    "fault": self._fault,
                    "duration_s": round(time.monotonic() - t0, 4),
                })

    def _start(self, status: int, headers: dict[str, str]) -> None:
        self._status = status
        self.send_response(status)
        self.send_header("X-Request-Id", "Root=1-" + uuid.uuid4().hex[:24])
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _send_bytes(self, status: int, body: bytes, headers: dict[str, str], method: str) -> None:
        headers = {**headers, "Content-Length": str(len(body))}
        self._start(status, headers)
        if method != "HEAD":
            self._write_throttled(body)

    def _write_throttled(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = self.state.throttle.chunk_size()
            self.state.throttle.take(min(n, len(view)))
            self.wfile.write(view[:n])
            self._sent += len(view[:n])
            view = view[n:]

    def _send_json(self, obj: Any, method: str, status: int = 200, headers: dict | None = None) -> None:
        body = json.dumps(obj).encode()
        self._send_bytes(status, body, {"Content-Type": "application/json; charset=utf-8", **(headers or {})}, method)

    def _send_error(self, e: HubError) -> None:
        headers = {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": e.message, **e.headers}
        if e.code:
            headers["X-Error-Code"] = e.code
        body = json.dumps({"error": e.message}).encode()
        self._send_bytes(e.status, body, headers, self.command)

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n > 10 * 1024 * 1024:
            raise HubError(413, "request body too large")
        self._body_read = True
        return self.rfile.read(n) if n else b""

    # ----------------------------------------------------------------- auth
    def _auth(self) -> bool:
        """True if the lab token was presented; raises 401 for any other Bearer token."""
        header = self.headers.get("Authorization")
        if header is None:
            return False
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and self.state.token_matches(value.strip()):
            return True
        raise HubError(401, "Invalid credentials in Authorization header")

    # ----------------------------------------------------------------- routing
    def _split_repo(self, segs: list[str]) -> tuple[GeneratedRepo | None, str, list[str]]:
        """(repo, repo_id, rest) trying `org/name` then `name`."""
        if len(segs) >= 2 and f"{segs[0]}/{segs[1]}" in self.state.repos:
            rid = f"{segs[0]}/{segs[1]}"
            return self.state.repos[rid], rid, segs[2:]
        if segs and segs[0] in self.state.repos:
            return self.state.repos[segs[0]], segs[0], segs[1:]
        return None, "/".join(segs[:2]), segs[2:]

    def _route(self, method: str) -> None:
        segs = self._raw_path.split("/")[1:]
        authed = self._auth()
        if segs[:2] == ["api", "whoami-v2"] and method == "GET":
            if not authed:
                raise HubError(401, "Invalid credentials in Authorization header")
            return self._send_json({"type": "user", "id": "0" * 24, "name": "sparkprov-lab",
                                    "fullname": "sparkprov lab", "orgs": [],
                                    "auth": {"type": "access_token", "accessToken": {"displayName": "lab",
                                                                                     "role": "read"}}}, method)
        if segs[:2] == ["api", "models"]:
            repo, rid, rest = self._split_repo([unquote(s) for s in segs[2:4]] + segs[4:])
            if repo is None:
                self._repo_not_found(authed)
            return self._api(method, repo, rest)
        if segs[:2] in (["api", "datasets"], ["api", "spaces"], ["datasets"], ["spaces"]):
            self._repo_not_found(authed)
        # /{repo}/resolve/{rev}/{path}
        repo, rid, rest = self._split_repo(segs)
        if repo is not None and len(rest) >= 3 and rest[0] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(method, repo, unquote(rest[1]), unquote("/".join(rest[2:])), authed)
        if repo is None and "resolve" in segs[1:3]:
            self._repo_not_found(authed)
        raise HubError(404, "Not Found")

    def _repo_not_found(self, authed: bool) -> None:
        # The Hub answers 401 to anonymous requests for missing (or private) repos, 404 when authenticated.
        raise HubError(404 if authed else 401, "Repository not found", "RepoNotFound")

    def _commit(self, repo: GeneratedRepo, rev: str) -> str:
        if rev in ("main", "refs/heads/main", repo.commit):
            return repo.commit
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _api(self, method: str, repo: GeneratedRepo, rest: list[str]) -> None:
        if not rest and method == "GET":
            return self._send_json(self._model_info(repo), method)
        if not rest:
            raise HubError(405, "Method not allowed")
        kind = rest[0]
        if kind == "revision" and len(rest) == 2 and method == "GET":
            self._commit(repo, unquote(rest[1]))
            return self._send_json(self._model_info(repo), method)
        if kind == "tree" and len(rest) >= 2 and method == "GET":
            commit = self._commit(repo, unquote(rest[1]))
            return self._tree(method, repo, commit, rest[1], unquote("/".join(rest[2:])).strip("/"))
        if kind == "paths-info" and len(rest) == 2 and method == "POST":
            commit = self._commit(repo, unquote(rest[1]))
            return self._paths_info(method, repo, commit)
        if kind == "refs" and len(rest) == 1 and method == "GET":
            return self._send_json({
                "branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": repo.commit}],
                "converts": [], "tags": [],
            }, method)
        if kind == "commits" and len(rest) == 2 and method == "GET":
            self._commit(repo, unquote(rest[1]))
            return self._send_json([{
                "id": repo.commit, "title": repo.commit_title, "message": "",
                "authors": [{"user": "sparkprov-lab"}], "date": COMMIT_DATE,
            }], method)
        raise HubError(404, "Not Found")

    # ----------------------------------------------------------------- API bodies
    def _model_info(self, repo: GeneratedRepo) -> dict:
        blobs = _truthy((self._query.get("blobs") or [None])[0])
        siblings = []
        for f in sorted(repo.files.values(), key=lambda f: f.path):
            s: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                s["size"] = f.size
                s["blobId"] = f.oid
                if f.lfs:
                    s["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": f.pointer_size}
            siblings.append(s)
        cfg = repo.config
        author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        info = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": author,
            "sha": repo.commit,
            "lastModified": COMMIT_DATE,
            "createdAt": COMMIT_DATE,
            "private": False,
            "disabled": False,
            "gated": "manual" if self.state.is_gated(repo.repo_id) else False,
            "downloads": 0,
            "likes": 0,
            "library_name": "transformers",
            "pipeline_tag": "text-generation",
            "tags": ["transformers", "safetensors", cfg.get("model_type", "llama"), "text-generation",
                     "conversational", "license:apache-2.0", "endpoints_compatible", "region:us"],
            "config": {"architectures": cfg.get("architectures"), "model_type": cfg.get("model_type"),
                       "tokenizer_config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}},
            "cardData": {"license": "apache-2.0", "library_name": "transformers", "pipeline_tag": "text-generation"},
            "transformersInfo": {"auto_model": "AutoModelForCausalLM", "pipeline_tag": "text-generation",
                                 "processor": "AutoTokenizer"},
            "safetensors": {"parameters": dict(repo.parameters), "total": sum(repo.parameters.values())},
            "siblings": siblings,
            "spaces": [],
            "usedStorage": sum(f.size for f in repo.files.values()),
        }
        expand = self._query.get("expand") or self._query.get("expand[]")
        if expand:
            return {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
        return info

    def _file_entry(self, repo: GeneratedRepo, f: RepoFile, expand: bool) -> dict:
        e: dict[str, Any] = {"type": "file", "oid": f.oid, "size": f.size, "path": f.path}
        if f.lfs:
            e["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
        if expand:
            e["lastCommit"] = {"id": repo.commit, "title": repo.commit_title, "date": COMMIT_DATE}
            e["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False, "virusNames": None},
                                       "pickleImportScan": None}
        return e

    def _dir_entry(self, repo: GeneratedRepo, path: str, expand: bool) -> dict:
        e: dict[str, Any] = {"type": "directory", "oid": repo.trees[path], "size": 0, "path": path}
        if expand:
            e["lastCommit"] = {"id": repo.commit, "title": repo.commit_title, "date": COMMIT_DATE}
        return e

    def _tree(self, method: str, repo: GeneratedRepo, commit: str, raw_rev: str, path: str) -> None:
        recursive = _truthy((self._query.get("recursive") or [None])[0])
        expand = _truthy((self._query.get("expand") or [None])[0])
        if path and path not in repo.trees:
            if path in repo.files:
                raise HubError(400, f"{path} is a file, not a folder")
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit})
        prefix = path + "/" if path else ""
        entries: list[dict] = []
        for d in repo.folders():
            if d.startswith(prefix) and (recursive or "/" not in d[len(prefix):]):
                entries.append(self._dir_entry(repo, d, expand))
        for f in sorted(repo.files.values(), key=lambda f: f.path):
            if f.path.startswith(prefix) and (recursive or "/" not in f.path[len(prefix):]):
                entries.append(self._file_entry(repo, f, expand))
        page = TREE_PAGE_SIZE_EXPANDED if expand else TREE_PAGE_SIZE
        cursor = (self._query.get("cursor") or [""])[0]
        try:
            start = int(base64.urlsafe_b64decode(cursor.encode() + b"==").decode()) if cursor else 0
        except ValueError:
            raise HubError(400, "invalid cursor") from None
        chunk = entries[start:start + page]
        headers = {"X-Repo-Commit": commit}
        if start + page < len(entries):
            nxt = base64.urlsafe_b64encode(str(start + page).encode()).decode().rstrip("=")
            host = self.headers.get("Host") or "%s:%d" % self.server.server_address[:2]
            q = f"recursive={str(recursive).lower()}&expand={str(expand).lower()}&cursor={nxt}"
            url = f"http://{host}/api/models/{repo.repo_id}/tree/{raw_rev}"
            if path:
                url += "/" + path
            headers["Link"] = f'<{url}?{q}>; rel="next"'
        self._send_json(chunk, method, headers=headers)

    def _paths_info(self, method: str, repo: GeneratedRepo, commit: str) -> None:
        body = self._read_body()
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if ctype == "application/json":
            data = json.loads(body or b"{}")
            paths = data.get("paths") or []
            expand = bool(data.get("expand"))
        else:
            form = parse_qs(body.decode(), keep_blank_values=True)
            paths = form.get("paths", [])
            expand = _truthy((form.get("expand") or [None])[0])
        if isinstance(paths, str):
            paths = [paths]
        out = []
        for p in paths:
            p = p.strip("/")
            if p in repo.files:
                out.append(self._file_entry(repo, repo.files[p], expand))
            elif p in repo.trees and p:
                out.append(self._dir_entry(repo, p, expand))
        self._send_json(out, method, headers={"X-Repo-Commit": commit})

    # ----------------------------------------------------------------- files
    def _resolve(self, method: str, repo: GeneratedRepo, rev: str, path: str, authed: bool) -> None:
        commit = self._commit(repo, rev)
        if self.state.is_gated(repo.repo_id) and not authed:
            raise HubError(
                401,
                f"Access to model {repo.repo_id} is restricted. You must have access to it and be authenticated "
                "to access it. Please log in.",
                "GatedRepo",
            )
        f = repo.files.get(path)
        if f is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit})
        etag = f'"{f.sha256 if f.lfs else f.oid}"'
        headers = {
            "X-Repo-Commit": commit,
            "ETag": etag,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream" if f.lfs else _content_type(path),
            "Content-Disposition": f'inline; filename="{path.rsplit("/", 1)[-1]}"',
            "Cache-Control": "public, max-age=31536000, immutable" if rev == commit else "private, max-age=0",
        }
        if f.lfs:
            headers["X-Linked-Etag"] = etag
            headers["X-Linked-Size"] = str(f.size)
        start, end, status = 0, f.size - 1, 200
        rng = self.headers.get("Range")
        if rng is not None and method == "GET":
            parsed = _parse_range(rng, f.size)
            if parsed is None:
                raise HubError(416, "Range Not Satisfiable", None, {"Content-Range": f"bytes */{f.size}"})
            start, end = parsed
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        length = end - start + 1 if f.size else 0
        headers["Content-Length"] = str(length)
        self._start(status, headers)
        if method == "HEAD" or length == 0:
            return
        cut = self.state.take_drop(unquote(self._raw_path), length)
        limit = length if cut is None else cut
        throttle = self.state.throttle
        sock = self.connection.fileno()
        with open(repo.file_path(path), "rb") as fh:
            offset, left = start, limit
            while left > 0:
                n = min(throttle.chunk_size() if throttle.bps else 8 * 1024 * 1024, left)
                throttle.take(n)
                while n > 0:  # sendfile: no copy through Python; may send less than asked
                    sent = os.sendfile(sock, fh.fileno(), offset, n)
                    if sent == 0:
                        raise BrokenPipeError("file shorter than its manifest")
                    offset += sent
                    n -= sent
                    left -= sent
                    self._sent += sent
        if cut is not None:
            self._dropped = True
            self.close_connection = True
            self.wfile.flush()
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ----------------------------------------------------------------- lab control
    def _lab(self, method: str) -> None:
        if not self.server.control_allowed(self.client_address[0]):
            raise HubError(403, "lab control API is only for the control machine")
        p = self._raw_path
        if p == "/_lab/health" and method in ("GET", "HEAD"):
            return self._send_json({"ok": True, "pid": os.getpid(),
                                    "repos": {r: g.commit for r, g in self.state.repos.items()}}, method)
        if p == "/_lab/control" and method == "GET":
            return self._send_json(self.state.settings(), method)
        if p == "/_lab/control" and method == "POST":
            try:
                body = json.loads(self._read_body() or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("control body must be a JSON object")
                settings = self.state.control(body)
            except (ValueError, TypeError, KeyError) as e:
                raise HubError(400, f"bad control request: {e}") from None
            self.server.log_line(f"control: {json.dumps(body)}")
            return self._send_json(settings, method)
        if p == "/_lab/requests" and method == "GET":
            with self.state.lock:
                log = list(self.state.log)
            return self._send_json(log, method)
        if p == "/_lab/requests" and method == "DELETE":
            with self.state.lock:
                self.state.log.clear()
            return self._send_json({"ok": True}, method)
        raise HubError(404, "Not Found")


def _content_type(path: str) -> str:
    if path.endswith(".json"):
        return "application/json; charset=utf-8"
    if path.endswith((".md", ".txt")) or path.endswith(".gitattributes"):
        return "text/plain; charset=utf-8"
    return "application/octet-stream"


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """Single `bytes=` range -> (start, end) inclusive, or None if unsatisfiable/unsupported."""
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    a, _, b = spec.strip().partition("-")
    try:
        if a == "":
            n = int(b)
            if n <= 0:
                return None
            return max(0, size - n), size - 1
        start = int(a)
        end = int(b) if b else size - 1
    except ValueError:
        return None
    if start >= size or end < start:
        return None
    return start, min(end, size - 1)


class HubServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, bind: str, port: int, state: HubState, log_stream=None):
        check_bind_address(bind)
        self.state = state
        self._log_stream = log_stream
        self._log_lock = threading.Lock()
        super().__init__((bind, port), HubHandler)

    def control_allowed(self, client_ip: str) -> bool:
        ip = ipaddress.ip_address(client_ip)
        return ip.is_loopback or client_ip == self.server_address[0]

    def log_line(self, line: str) -> None:
        if self._log_stream is None:
            return
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        with self._log_lock:
            self._log_stream.write(f"{stamp} {line}\n")
            self._log_stream.flush()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def start_in_thread(repos: list[GeneratedRepo], bind: str = "127.0.0.1", port: int = 0, token: str | None = None,
                    throttle_bps: int | None = None, log_stream=None) -> HubServer:
    """An in-process hub on a background thread (tests, embedding). Stop with server.shutdown(); server_close()."""
    server = HubServer(bind, port, HubState(repos, token=token, throttle_bps=throttle_bps), log_stream)
    threading.Thread(target=server.serve_forever, name="lab-hub", daemon=True).start()
    return server


def read_token_file(path: Path) -> str:
    """The lab token, from a file only the owner can read (never from argv)."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise PermissionError(f"{path}: token file must not be readable by group/others (chmod 600)")
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"{path}: empty token file")
    return token
