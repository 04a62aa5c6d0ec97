"""The lab's container registry: Debian's docker-registry (distribution 2.x) on the lab bridge.

One registry process serves every image the lab needs, from one storage directory:

* the main listener (``bind_ip:port``, 10.77.0.1:5000 in the lab) is where images are pushed
  and what every lab host's dockerd uses as its ``registry-mirrors`` entry, so Docker Hub names
  (``vllm/vllm-openai:TAG``) are pulled from it;
* an *alias* listener (``bind_ip:80``, plain HTTP, read-only, same storage) serves the names
  of other registries (``nvcr.io/nvidia/vllm:TAG`` is stored as ``nvidia/vllm:TAG``). A lab host
  reaches it when its /etc/hosts maps the registry's host name to ``bind_ip`` and its daemon
  lists that host name in ``insecure-registries``: dockerd 20.10 then tries
  ``https://nvcr.io`` (refused: nothing listens on 443) and falls back to ``http://nvcr.io``,
  port 80, which is this listener. No traffic leaves the lab. See :func:`client_settings`.

distribution 2.x listens on exactly one address per process, so the alias is a second
``docker-registry serve`` process with a read-only configuration over the same storage.

State lives under ``state_dir/registry/``: ``config.yml``, ``alias.yml``, ``storage/``,
``registry.log``, ``alias.log``. Processes are found by their exact command line (no pid files
that can go stale).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REGISTRY_BIN = "/usr/bin/docker-registry"
ALIAS_PORT = 80  # dockerd's plain-HTTP fallback for an insecure registry named without a port

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RegistryError(RuntimeError):
    pass


def _dir(state_dir: Path) -> Path:
    return Path(state_dir) / "registry"


def _config_text(storage: Path, addr: str, *, readonly: bool) -> str:
    """distribution's configuration (YAML) for one listener over `storage`."""
    maintenance = ({"readonly": {"enabled": True}, "uploadpurging": {"enabled": False}} if readonly else
                   {"uploadpurging": {"enabled": True, "age": "168h", "interval": "24h", "dryrun": False}})
    return yaml.safe_dump({
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True},
                    "maintenance": maintenance},
        "http": {"addr": addr, "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }, sort_keys=False)


def _processes(config: Path) -> list[int]:
    """Pids of docker-registry processes serving exactly this config file."""
    want = [REGISTRY_BIN.encode(), b"serve", str(config).encode()]
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if argv == want:
            pids.append(int(entry))
    return pids


def _answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with _NO_PROXY.open(url.rstrip("/") + "/v2/", timeout=timeout) as resp:
            return resp.status == 200 and "Docker-Distribution-Api-Version" in resp.headers
    except (urllib.error.URLError, OSError):
        return False


def _start(config: Path, log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    env.pop("OTEL_TRACES_EXPORTER", None)
    # sh backgrounds the server and exits at once, so it is reparented and never a zombie of
    # ours; setsid detaches it from our session and terminal.
    subprocess.run(
        ["sh", "-c", 'setsid "$0" serve "$1" </dev/null >>"$2" 2>&1 &', REGISTRY_BIN,
         str(config), str(log)],
        check=True, env=env,
    )


def _stop(config: Path, timeout: float = 10.0) -> None:
    pids = _processes(config)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while _processes(config) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in _processes(config):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while _processes(config) and time.monotonic() < deadline:
        time.sleep(0.05)


def _ensure_one(config: Path, text: str, log: Path, url: str, timeout: float) -> None:
    current = config.read_text() if config.exists() else None
    running = _processes(config)
    if running and current == text and _answers(url):
        return
    if running:
        _stop(config)
    tmp = config.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, config)
    _start(config, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _answers(url, timeout=1.0):
            return
        if not _processes(config):
            time.sleep(0.2)  # it may still be exec'ing; check once more before giving up
            if not _processes(config):
                break
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    _stop(config)
    raise RegistryError(f"docker-registry ({config.name}) did not answer on {url}/v2/:\n{tail}")


def ensure_registry(state_dir: Path, bind_ip: str = "10.77.0.1", port: int = 5000,
                    *, alias: bool = True, timeout: float = 20.0) -> str:
    """Start (or keep) the lab registry; return its URL, ``http://bind_ip:port``.

    Idempotent: a registry already serving the same configuration is left alone; one serving a
    different one (another address) is restarted. Waits until ``/v2/`` answers. With ``alias``
    (the default) the read-only listener on ``bind_ip:80`` is started too; it serves the names
    of registries other than Docker Hub (see the module docstring). The caller guarantees that
    ``bind_ip`` exists (the lab bridge is up).
    """
    if not Path(REGISTRY_BIN).exists():
        raise RegistryError(f"{REGISTRY_BIN} not found: apt-get install docker-registry")
    d = _dir(state_dir)
    storage = d / "storage"
    storage.mkdir(parents=True, exist_ok=True)
    url = f"http://{bind_ip}:{port}"
    _ensure_one(d / "config.yml", _config_text(storage, f"{bind_ip}:{port}", readonly=False),
                d / "registry.log", url, timeout)
    alias_cfg = d / "alias.yml"
    if alias and port != ALIAS_PORT:
        _ensure_one(alias_cfg,
                    _config_text(storage, f"{bind_ip}:{ALIAS_PORT}", readonly=True),
                    d / "alias.log", f"http://{bind_ip}:{ALIAS_PORT}", timeout)
    elif _processes(alias_cfg):
        _stop(alias_cfg)
    return url


def registry_running(state_dir: Path) -> bool:
    """True when the main registry process runs and answers on the address it was given."""
    config = _dir(state_dir) / "config.yml"
    if not config.exists() or not _processes(config):
        return False
    addr = _addr_of(config)
    return addr is not None and _answers(f"http://{addr}")


def alias_running(state_dir: Path) -> bool:
    config = _dir(state_dir) / "alias.yml"
    if not config.exists() or not _processes(config):
        return False
    addr = _addr_of(config)
    return addr is not None and _answers(f"http://{addr}")


def _addr_of(config: Path) -> str | None:
    """The address a configuration (_config_text's) listens on."""
    try:
        return yaml.safe_load(config.read_text())["http"]["addr"]
    except (yaml.YAMLError, TypeError, KeyError):
        return None


def stop_registry(state_dir: Path) -> None:
    """Stop both listeners. Storage is kept (``lab.down`` removes the state directory)."""
    d = _dir(state_dir)
    for name in ("alias.yml", "config.yml"):
        _stop(d / name)


def client_settings(registry_url: str, hostnames: list[str]) -> dict:
    """What a lab host's dockerd needs to pull every lab image from this registry.

    ``hostnames``: registries other than Docker Hub that image names use (from
    :func:`sparklab.image.registry_hostnames`), e.g. ``["nvcr.io"]``.
    Returns ``{"daemon": {...daemon.json keys...}, "etc_hosts": ["10.77.0.1 nvcr.io", ...]}``.
    """
    host = registry_url.split("://", 1)[1].rsplit(":", 1)[0]
    hostport = registry_url.split("://", 1)[1]
    return {
        "daemon": {
            "registry-mirrors": [registry_url],
            "insecure-registries": [hostport, *hostnames],
        },
        "etc_hosts": [f"{host} {' '.join(hostnames)}"] if hostnames else [],
    }
