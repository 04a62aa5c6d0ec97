"""On-demand deployments on the node (issue 35, docs/on-demand.md): the labels cluster-up --park
puts on a parked container, the state `invoke status` shows, and the guard's authenticated start
and stop of a deployment this node already holds.

A request to the guard names a deployment and an action, nothing else: no argv, no image, no
container. It is signed with HMAC-SHA256 over method, path, timestamp and nonce under a key that
`gateway up` writes 0600 on every node and into the gateway's 0600 config; the guard refuses a
request whose timestamp is outside REPLAY_WINDOW_S of its clock or whose nonce it saw within that
window (NonceCache), and acts only on the deployment's containers labelled on-demand.

Standard library only (the node contract): the guard runs it as root on a bare Spark, and the
gateway's hook file signs with the same `sign`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time

# The labels of a parked deployment's containers (cluster-up --park, a playbook's on_demand: true).
# Labels are outside the recipe hash (serving/spec.py assemble): a parked container carries the hash
# a start of the same argv would.
ON_DEMAND_LABEL = "sparkprov.on_demand"
IDLE_STOP_LABEL = "sparkprov.idle_stop_s"
# its --gpu-memory-utilization: the gateway's admission reserves that share of the host on a start
# (catalog/memory.py budget_gib), the planner's figure for one vLLM instance
UTILIZATION_LABEL = "sparkprov.gpu_memory_utilization"

# What `invoke status` shows of an on-demand container (`state`).
PARKED, STARTING, SERVING = "parked", "starting", "serving"

# The signed request's headers, and how far its time may be from the guard's.
TIME_HEADER = "X-Sparkprov-Time"
NONCE_HEADER = "X-Sparkprov-Nonce"
SIGNATURE_HEADER = "X-Sparkprov-Signature"
REPLAY_WINDOW_S = 30.0
NONCE_RE = re.compile(r"[0-9a-f]{32}\Z")
# what the guard answers: every on-demand deployment it holds, or one's state, start or stop
LIST_PATH = "/v1/deployments"
PATH_RE = re.compile(r"/v1/deployments/([a-z0-9][a-z0-9._-]{0,62})/(start|stop|state)\Z")
MAX_BODY = 1024  # {"reason": "..."}: why the gateway starts or stops it (the journal and the history say it)
KEY_BYTES = 32  # the shared key: 32 random bytes, written as 64 hex digits
STOPPED = ("created", "exited")  # docker's states of a container that holds no memory


def is_on_demand(container: dict) -> bool:
    return (container.get("labels") or {}).get(ON_DEMAND_LABEL) == "1"


def state(container: dict, health: int | None) -> str:
    """What an on-demand container is: parked (created or stopped), starting (running, its API not
    answering 200 yet), serving; another docker state as docker says it."""
    status = container.get("status") or "?"
    if status in STOPPED:
        return PARKED
    if status == "running":
        return SERVING if health == 200 else STARTING
    return status


def canonical(method: str, path: str, timestamp: str, nonce: str, body: bytes = b"") -> bytes:
    """What the signature covers: one line per part and the body's SHA-256 (no part may hold a line
    break: the path and nonce are checked against their patterns, the time is digits)."""
    return "\n".join((method.upper(), path, timestamp, nonce, hashlib.sha256(body).hexdigest())).encode()


def sign(key: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes = b"") -> str:
    return hmac.new(key, canonical(method, path, timestamp, nonce, body), hashlib.sha256).hexdigest()


def signed_headers(key: bytes, method: str, path: str, body: bytes = b"", now: float | None = None,
                   nonce: str | None = None) -> dict:
    """The headers of a signed request (the gateway's hook sends these)."""
    import secrets

    ts = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_hex(16)
    return {TIME_HEADER: ts, NONCE_HEADER: nonce, SIGNATURE_HEADER: sign(key, method, path, ts, nonce, body)}


def parse_key(text: str) -> bytes | None:
    """The shared key from its file (64 hex digits); None when the file holds no key."""
    t = text.strip()
    if not re.fullmatch(r"[0-9a-f]{64}", t):
        return None
    return bytes.fromhex(t)


class NonceCache:
    """The nonces of the requests accepted within the replay window (older ones fall out: a request
    that old is refused by its time anyway). Bounded: past `limit` live nonces a request is refused
    (a flood of signed requests is the key's holder misbehaving, not a reason to grow)."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, limit: int = 10000):
        self.window_s, self.limit = window_s, limit
        self.seen: dict[str, float] = {}

    def add(self, nonce: str, now: float) -> str | None:
        """Why `nonce` is refused (None: it is new, and now remembered)."""
        self.seen = {n: t for n, t in self.seen.items() if now - t <= 2 * self.window_s}
        if nonce in self.seen:
            return "nonce seen before (a replayed request)"
        if len(self.seen) >= self.limit:
            return f"more than {self.limit} requests within {2 * self.window_s:g}s"
        self.seen[nonce] = now
        return None


def verify(key: bytes | None, method: str, path: str, headers: dict, body: bytes, now: float, nonces: NonceCache,
           window_s: float = REPLAY_WINDOW_S) -> str | None:
    """Why a request is refused (None: it is authentic and new). The signature is checked before the
    nonce is remembered, so an unsigned request cannot fill the cache."""
    if key is None:
        return "no on-demand key on this node (gateway up writes it)"
    given = {k.lower(): v for k, v in headers.items()}  # HTTP header names are case-insensitive
    ts, nonce, sig = (given.get(h.lower()) or "" for h in (TIME_HEADER, NONCE_HEADER, SIGNATURE_HEADER))
    if not ts.isdigit() or len(ts) > 12 or not NONCE_RE.fullmatch(nonce) or not re.fullmatch(r"[0-9a-f]{64}", sig):
        return "unsigned request"
    if not hmac.compare_digest(sign(key, method, path, ts, nonce, body), sig):
        return "bad signature"
    if abs(now - int(ts)) > window_s:
        return f"request time {int(ts) - now:+.0f}s from the node's clock, outside {window_s:g}s"
    return nonces.add(nonce, now)


def plan(containers: list[dict], deployment: str, action: str) -> tuple[list[str], tuple[int, str] | None]:
    """Which of the node's containers a start or stop of `deployment` acts on (names), or the HTTP
    status and reason it is refused with: only the deployment's containers, and only when every one of
    them is labelled on-demand; a start acts on the stopped ones, a stop on the running ones, a state
    read on none."""
    mine = [c for c in containers if (c.get("labels") or {}).get("sparkprov.deployment") == deployment]
    if not mine:
        return [], (404, f"this node holds no container of {deployment}")
    fixed = [c["name"] for c in mine if not is_on_demand(c)]
    if fixed:
        return [], (403, f"{', '.join(fixed)} is not on demand (only cluster-up starts and stops it)")
    if action == "start":
        return [c["name"] for c in mine if c.get("status") in STOPPED], None
    if action == "stop":
        return [c["name"] for c in mine if c.get("status") in ("running", "restarting", "paused")], None
    return [], None


def held_by_guard(names: list[str], held: dict, stood_down: dict | None) -> str | None:
    """Why the guard will not start these containers on a request (None: it will): it stood down, or
    it holds one stopped itself (memory, a stall, a crash loop) until its own restart rule lets it go;
    demand does not overrule the guard."""
    if stood_down:
        return f"the node's guard stood down ({stood_down.get('why')}): invoke guard --resume first"
    mine = [n for n in names if n in held]
    if mine:
        return f"the node's guard holds {', '.join(mine)} stopped ({held[mine[0]].get('kind')}) until memory is back"
    return None


def describe(containers: list[dict], health: dict[str, int | None]) -> list[dict]:
    """Each on-demand container the node holds, as the guard answers it: deployment, name, state, port."""
    return [{"deployment": (c.get("labels") or {}).get("sparkprov.deployment"), "name": c["name"],
             "state": state(c, health.get(c["name"])), "status": c.get("status"), "port": c.get("port"),
             "model": (c.get("labels") or {}).get("sparkprov.model"),
             "idle_stop_s": int(v) if (v := (c.get("labels") or {}).get(IDLE_STOP_LABEL, "")).isdigit() else None}
            for c in containers if is_on_demand(c)]


def request_reason(body: bytes) -> str:
    """The reason a signed body gives, one printable line of at most 200 characters."""
    import json

    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return ""
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return "".join(ch for ch in str(reason or "") if ch.isprintable())[:200]
