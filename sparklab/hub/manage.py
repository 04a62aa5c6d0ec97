"""Start / stop the lab hub as a detached process, and talk to its control API."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable

from .repos import RepoSpec, coerce_spec, ensure_generated
from .server import check_bind_address

DEFAULT_REPOS: tuple[RepoSpec, ...] = (
    RepoSpec("sparkprov-lab/tiny-llm", num_shards=2, total_size=2 * 1024 * 1024),
    RepoSpec("sparkprov-lab/tiny-gated", num_shards=2, total_size=2 * 1024 * 1024, gated=True),
)
START_TIMEOUT_S = 60.0
CATALOG_REPO_BYTES = 4 * 1024 * 1024   # each catalog repo, generated small (the real ones are GBs)
TOKEN_FILE = "hf_token"                # the lab's HF token, 0600 in the lab state dir


def catalog_repos() -> list[RepoSpec]:
    """Every repo of the model catalog, generated small (2 shards, CATALOG_REPO_BYTES) with the
    catalog's config.json values; a repo gated in the catalog is gated here (behind the lab token)."""
    from sparkprov.catalog.load import load_catalog

    return [RepoSpec(info.repo, num_shards=2, total_size=CATALOG_REPO_BYTES, gated=info.gated,
                     config=dict(info.config or {}))
            for info in load_catalog().repos()]


def lab_tiny_repo() -> RepoSpec:
    """The lab's real model, as trained on this machine (built once: sparklab.tinymodel)."""
    from sparklab.tinymodel import REPO_ID, ensure_tiny_model

    return RepoSpec(REPO_ID, num_shards=1, files_dir=str(ensure_tiny_model()))


def lab_tiny_b_repo() -> RepoSpec:
    """lab-tiny's sibling that answers one question otherwise (sparklab/tiny/train_b.py), for the
    on-demand tests: published only where a test asks for it (ensure_lab_hub's ``extra``)."""
    from sparklab.tinymodel import REPO_ID_B, ensure_tiny_model_b

    return RepoSpec(REPO_ID_B, num_shards=1, files_dir=str(ensure_tiny_model_b()))


def lab_repos(extra: Iterable[RepoSpec] = ()) -> list[RepoSpec]:
    """What the lab hub serves by default: DEFAULT_REPOS, the trained lab-tiny, ``extra``, then every
    other catalog repo (generated)."""
    specs = [*DEFAULT_REPOS, lab_tiny_repo(), *extra]
    seen = {s.repo_id for s in specs}
    for spec in catalog_repos():
        if spec.repo_id not in seen:
            seen.add(spec.repo_id)
            specs.append(spec)
    return specs


def lab_token(state_dir: Path) -> str:
    """The lab's HF token (stable across lab.up runs): state_dir/hf_token, mode 0600, made once."""
    path = Path(state_dir) / TOKEN_FILE
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    if not token:
        import secrets

        token = "hf_sparkprovLab" + secrets.token_hex(16)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def ensure_lab_hub(state_dir: Path, bind_ip: str, port: int = 8080, extra: Iterable[RepoSpec] = ()) -> str:
    """The lab hub as `invoke lab.up` runs it: lab_repos() (generated once, cached), gated ones behind
    lab_token(state_dir); ``extra`` repos beside lab-tiny (a test's: lab_tiny_b_repo()). Idempotent:
    a hub already serving exactly this is left running (other repos: restarted, same address)."""
    return ensure_hub(state_dir, bind_ip, port, repos=lab_repos(extra), token=lab_token(state_dir))


def default_root() -> Path:
    """Where generated repos are cached: hub/ of the lab's cache (state.cache_root, read at each call)."""
    from sparklab.state import cache_root

    return cache_root() / "hub"


def _hub_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "hub"


# How a hub process is recognised by its argv: `python -m sparklab.hub`, or the module's name
# before the lab left the sparkprov package, so that a hub started by an older checkout and still
# running is stopped or reused, not left holding the port.
HUB_MODULES = (b"sparklab.hub", b"sparkprov.lab.hub")


def _pid_is_hub(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(m in cmdline for m in HUB_MODULES)


def _read_state(hub_dir: Path) -> dict | None:
    try:
        st = json.loads((hub_dir / "state.json").read_text())
        pid = int((hub_dir / "hub.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    if st.get("pid") != pid or not _pid_is_hub(pid):
        return None
    return st


def hub_status(state_dir: Path) -> dict | None:
    """{pid, url, ...} of the running hub of this state dir, or None."""
    st = _read_state(_hub_dir(state_dir))
    if st is None:
        return None
    try:
        health = HubControl(st["url"]).health()
    except OSError:
        return None
    return st if health.get("pid") == st["pid"] else None


def ensure_hub(
    state_dir: Path,
    bind_ip: str,
    port: int = 8080,
    repos: Iterable[RepoSpec | str | dict] | None = None,
    token: str | None = None,
    *,
    root: Path | None = None,
    throttle_bps: int | None = None,
) -> str:
    """Start the hub if it is not running with these settings; return its base url (idempotent).

    Repos are generated (once) into `root` before the server starts. If a hub of this state dir runs with
    other settings (repos, address, token, throttle), it is restarted. The token goes to a 0600 file in
    state_dir/hub, never to argv.
    """
    check_bind_address(bind_ip)
    hub_dir = _hub_dir(state_dir)
    hub_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(hub_dir, 0o700)
    specs = [coerce_spec(r) for r in (DEFAULT_REPOS if repos is None else repos)]
    if not specs:
        raise ValueError("no repos to serve")
    if len({s.repo_id for s in specs}) != len(specs):
        raise ValueError("duplicate repo ids")
    root = Path(root) if root is not None else default_root()
    url = f"http://{bind_ip}:{port}"
    spec_json = json.dumps({"repos": [s.to_json() for s in specs]}, indent=1, sort_keys=True)
    fingerprint = hashlib.sha256(json.dumps({
        "spec": spec_json, "bind": bind_ip, "port": port, "root": str(root), "throttle": throttle_bps,
        "token": hashlib.sha256(token.encode()).hexdigest() if token else None,
    }, sort_keys=True).encode()).hexdigest()

    running = hub_status(state_dir)
    if running is not None and running.get("fingerprint") == fingerprint:
        return url
    if running is not None or (hub_dir / "hub.pid").exists():
        stop_hub(state_dir)

    for spec in specs:
        ensure_generated(spec, root)

    spec_path = hub_dir / "spec.json"
    spec_path.write_text(spec_json)
    token_path = hub_dir / "token"
    if token:
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.chmod(token_path, 0o600)
    elif token_path.exists():
        token_path.unlink()

    argv = [sys.executable, "-m", "sparklab.hub", "--bind", bind_ip, "--port", str(port),
            "--root", str(root), "--spec", str(spec_path)]
    if token:
        argv += ["--token-file", str(token_path)]
    if throttle_bps:
        argv += ["--throttle", str(throttle_bps)]
    env = dict(os.environ)
    # the directory holding the sparklab package (the checkout: the lab is in no installed wheel)
    lab_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = lab_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(hub_dir / "hub.log", "ab")
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env=env, cwd="/")
    finally:
        log.close()
    (hub_dir / "hub.pid").write_text(f"{proc.pid}\n")
    (hub_dir / "state.json").write_text(json.dumps({
        "pid": proc.pid, "url": url, "bind": bind_ip, "port": port, "root": str(root),
        "fingerprint": fingerprint, "repos": [s.repo_id for s in specs],
    }, indent=1))

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lab hub exited with {proc.returncode}:\n{_log_tail(hub_dir)}")
        try:
            if HubControl(url).health().get("pid") == proc.pid:
                return url
        except OSError:
            pass
        time.sleep(0.1)
    stop_hub(state_dir)
    raise RuntimeError(f"lab hub did not answer on {url} within {START_TIMEOUT_S}s:\n{_log_tail(hub_dir)}")


def stop_hub(state_dir: Path) -> bool:
    """Stop the hub of this state dir (only our own process, by its pid). True if one was running."""
    hub_dir = _hub_dir(state_dir)
    was_running = False
    try:
        pid = int((hub_dir / "hub.pid").read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None and _pid_is_hub(pid):
        was_running = True
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _pid_is_hub(pid):
            _reap(pid)
            time.sleep(0.05)
        if _pid_is_hub(pid):
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
            _reap(pid)
    for name in ("hub.pid", "state.json", "token"):
        try:
            (hub_dir / name).unlink()
        except FileNotFoundError:
            pass
    return was_running


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)  # our child when started from this process: do not leave a zombie
    except ChildProcessError:
        pass


def _log_tail(hub_dir: Path, n: int = 4000) -> str:
    try:
        return (hub_dir / "hub.log").read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


class HubControl:
    """Client of the hub's /_lab API (from the control machine)."""

    def __init__(self, base_url: str, timeout: float = 5.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: {e.code} {e.headers.get('X-Error-Message')}") from None

    def health(self) -> dict:
        return self._call("GET", "/_lab/health")

    def settings(self) -> dict:
        return self._call("GET", "/_lab/control")

    def set(self, **control: Any) -> dict:
        """POST /_lab/control, e.g. set(throttle_bps=1_000_000), set(fail_next={...}), set(clear_faults=True)."""
        return self._call("POST", "/_lab/control", control)

    def requests(self) -> list[dict]:
        return self._call("GET", "/_lab/requests")

    def clear_requests(self) -> None:
        self._call("DELETE", "/_lab/requests")
