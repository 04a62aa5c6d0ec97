"""An Ollama-like server per host (standins/ollama): 127.0.0.1:11434 inside the host, one
model loaded (really holding SIZE_MB of memory) until POST /api/generate keep_alive=0."""
from __future__ import annotations

import json
import time

from .hosts import nsexec, nspopen, write_file
from .state import host_dir
from .gb10 import STANDINS

CONF = "/etc/sparkprov-lab/ollama.conf"
LOG = "/var/log/ollama.log"
_GET = ("import json,sys,urllib.request as u;o=u.build_opener(u.ProxyHandler({}));"
        "print(o.open('http://127.0.0.1:11434'+sys.argv[1],timeout=5).read().decode())")


def _install(name: str) -> None:
    dst = host_dir(name) / "fs" / "usr-local" / "bin" / "ollama"
    src = (STANDINS / "ollama").read_bytes()
    if not dst.exists() or dst.read_bytes() != src:
        dst.write_bytes(src)
        dst.chmod(0o755)


def ollama_pid(name: str) -> int | None:
    r = nsexec(name, ["pgrep", "-f", "-x", "/usr/bin/python3 /usr/local/bin/ollama serve"],
               check=False)
    pids = [int(p) for p in r.stdout.split()]
    # pgrep sees every process of the machine (no PID namespace): keep this host's
    mine = nsexec(name, ["readlink", "/proc/self/ns/mnt"]).stdout.strip()
    for p in pids:
        if nsexec(name, ["readlink", f"/proc/{p}/ns/mnt"], check=False).stdout.strip() == mine:
            return p
    return None


def ollama_running(name: str) -> bool:
    return ollama_pid(name) is not None


def start_ollama(name: str, preload: str = "llama3.1:8b", size_mb: int = 200) -> bool:
    """Start the stand-in with `preload` loaded. True if it was started."""
    _install(name)
    changed = write_file(name, CONF, f"PRELOAD={preload}\nSIZE_MB={size_mb}\n")
    if ollama_pid(name) and not changed:
        return False
    stop_ollama(name)
    nspopen(name, ["/usr/local/bin/ollama", "serve"], log=LOG)
    for _ in range(100):
        if nsexec(name, ["python3", "-c", _GET, "/api/version"], check=False).returncode == 0:
            return True
        time.sleep(0.05)
    raise RuntimeError(f"{name}: ollama stand-in did not start")


def stop_ollama(name: str) -> bool:
    pid = ollama_pid(name)
    if not pid:
        return False
    nsexec(name, ["kill", str(pid)], check=False)
    return True


def loaded_models(name: str) -> list[dict]:
    """GET /api/ps inside the host."""
    out = nsexec(name, ["python3", "-c", _GET, "/api/ps"]).stdout
    return json.loads(out)["models"]
