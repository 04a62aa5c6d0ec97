"""The Docker Engine API over docker's unix socket (standard library only): what the guard reads of
the node's containers and how it stops and starts them, with no `docker` process per sample.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from datetime import datetime

MANAGED = "sparkprov.managed=1"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.socket_path)
        self.sock = s


class DockerError(Exception):
    pass


class Docker:
    def __init__(self, socket_path: str = "/var/run/docker.sock"):
        self.socket_path = socket_path

    def request(self, method: str, path: str, timeout: float = 10) -> tuple[int, bytes]:
        conn = _UnixConnection(self.socket_path, timeout)
        try:
            conn.request(method, path, headers={"Host": "docker"})
            r = conn.getresponse()
            return r.status, r.read()
        except OSError as e:
            raise DockerError(f"docker's socket {self.socket_path}: {method} {path.split('?')[0]}: {e}") from None
        finally:
            conn.close()

    def _json(self, path: str) -> object:
        status, body = self.request("GET", path)
        if status != 200:
            raise DockerError(f"GET {path}: HTTP {status} {body[:200]!r}")
        return json.loads(body)

    def containers(self, label: str = MANAGED) -> list[dict]:
        """Every container with `label`, running or not, inspected: see `summarize`."""
        filters = urllib.parse.quote(json.dumps({"label": [label]}))
        listed = self._json(f"/containers/json?all=1&filters={filters}")
        out = []
        for c in listed if isinstance(listed, list) else []:
            try:
                out.append(summarize(self._json(f"/containers/{c['Id']}/json")))
            except DockerError:
                continue   # removed between the list and the inspect
        return out

    def stop(self, cid: str, grace_s: float) -> None:
        """docker stop: the stop signal, SIGKILL after `grace_s`; 304 (not running) is no error."""
        status, body = self.request("POST", f"/containers/{cid}/stop?t={int(grace_s)}", timeout=grace_s + 60)
        if status not in (204, 304):
            raise DockerError(f"stop {cid[:12]}: HTTP {status} {body[:200]!r}")

    def start(self, cid: str) -> None:
        status, body = self.request("POST", f"/containers/{cid}/start", timeout=60)
        if status not in (204, 304):
            raise DockerError(f"start {cid[:12]}: HTTP {status} {body[:200]!r}")


def epoch(stamp: str | None) -> float | None:
    """Docker's RFC 3339 time ("2026-11-28T13:01:02.123456789Z") in seconds since the epoch; None for
    none or docker's zero time (never started)."""
    if not stamp or stamp.startswith("0001-"):
        return None
    head, _, frac = stamp.rstrip("Z").partition(".")
    tz = ""
    for sign in ("+", "-"):
        if sign in frac:
            frac, _, rest = frac.partition(sign)
            tz = sign + rest
    if not frac and len(head) > 19:   # an offset straight after the seconds
        head, tz = head[:19], head[19:]
    try:
        dt = datetime.fromisoformat(head + (tz or "+00:00"))
    except ValueError:
        return None
    return dt.timestamp() + (float("0." + frac[:9]) if frac.isdigit() else 0.0)


def summarize(inspected: dict) -> dict:
    """What the guard keeps of a `GET /containers/ID/json`: name, id, status, restarts, started (epoch),
    labels, and the API port its labels name (None: a headless rank, the gateway)."""
    st, cfg = inspected.get("State") or {}, inspected.get("Config") or {}
    labels = cfg.get("Labels") or {}
    port = labels.get("sparkprov.port")
    return {"name": str(inspected.get("Name") or "").lstrip("/"), "id": inspected.get("Id"),
            "status": st.get("Status"), "restarts": int(inspected.get("RestartCount") or 0),
            "started": epoch(st.get("StartedAt")), "pid": st.get("Pid") or None, "labels": labels,
            "port": int(port) if port and str(port).isdigit() else None}
