"""What runs on the host besides sparkprov's containers and holds the GPU or its memory: docker as the
login user sees it and its daemon's settings, the GPU smoke test's record, an Ollama server (G14)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx, key_values
from sparkprov.transport.shell import cmd, quote

# ---------------------------------------------------------------------------------------------
# Docker
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DockerState(Fact):
    """Docker as the login user sees it, in this session: CLI, daemon answering (`docker info`),
    session groups, socket ownership, the NVIDIA container toolkit."""

    def command(self, sh: ShellCtx) -> str:
        return (
            "printf 'cli=%s\\n' \"$(command -v docker || true)\"\n"
            "printf 'session_groups=%s\\n' \"$(id -Gn)\"\n"
            "s=/var/run/docker.sock; [ -S \"$s\" ] || s=/run/docker.sock\n"
            "printf 'socket=%s\\n' \"$( [ -S \"$s\" ] && stat -c '%n|%U|%G|%a' \"$s\" || true)\"\n"
            "if command -v docker >/dev/null 2>&1; then\n"
            "  o=$(docker info --format '{{.ServerVersion}}|{{.DefaultRuntime}}|{{range $k, $v := .Runtimes}}{{$k}} {{end}}' 2>&1); r=$?\n"
            "  printf 'info_rc=%s\\ninfo=%s\\n' \"$r\" \"$(printf '%s' \"$o\" | tr '\\n' ' ' | cut -c1-400)\"\n"
            "fi\n"
            "printf 'ctk=%s\\n' \"$(nvidia-ctk --version 2>/dev/null | head -n 1)\"\n"
            "printf 'hook=%s\\n' \"$(command -v nvidia-container-runtime-hook || true)\"\n"
            "printf 'toolkit_pkg=%s\\n' \"$(dpkg-query -W -f='${Status}|${Version}' nvidia-container-toolkit 2>/dev/null || true)\"\n"
            "printf 'systemctl=%s\\n' \"$(command -v systemctl || true)\""
        )

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_docker_state(out)


def parse_docker_state(out: str) -> dict[str, Any]:
    kv = key_values(out)
    sock = kv.get("socket", "")
    socket = None
    if sock:
        path, owner, group, mode = sock.split("|")
        socket = {"path": path, "owner": owner, "group": group, "mode": int(mode, 8)}
    info = kv.get("info", "")
    access = kv.get("info_rc") == "0"
    server = runtimes = default_rt = None
    if access:
        parts = info.split("|")
        server, default_rt = parts[0].strip() or None, (parts[1].strip() if len(parts) > 1 else None)
        runtimes = parts[2].split() if len(parts) > 2 else []
    pkg = kv.get("toolkit_pkg", "")
    pkg_version = pkg.split("|", 1)[1] if pkg.startswith("install ok installed|") else None
    ctk = kv.get("ctk") or None
    ctk_version = re.search(r"version ([0-9][\w.-]*)", ctk).group(1) if ctk and re.search(r"version ([0-9][\w.-]*)", ctk) else None
    return {"cli": kv.get("cli") or None, "session_groups": kv.get("session_groups", "").split(),
            "socket": socket, "access": access, "server_version": server, "default_runtime": default_rt,
            "runtimes": runtimes or [], "error": None if access or not kv.get("cli") else info.strip(),
            "toolkit": {"ctk": ctk_version, "hook": kv.get("hook") or None, "package": pkg_version},
            "systemctl": kv.get("systemctl") or None}


@dataclass(frozen=True)
class DockerDaemon(Fact):
    """Is the docker daemon running (and, given an image, is that image present)? Asked as root,
    so it does not depend on the login user's access (that is DockerState's question)."""

    image: str = ""
    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        check = (f"if {cmd('docker', 'image', 'inspect', '--format', '{{.Id}}', self.image)} >/dev/null 2>&1; "
                 "then echo image=present; else echo image=absent; fi\n") if self.image else ""
        return ("command -v docker >/dev/null 2>&1 || { echo @nocli; exit 0; }\n"
                "o=$(docker info --format 'server={{.ServerVersion}}' 2>&1); r=$?\n"
                "printf '%s\\n' \"$o\" | tail -n 1\n"
                "[ $r -eq 0 ] || exit $r\n" + check)

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        lines = out.strip().splitlines()
        text = lines[0] if lines else ""
        if text == "@nocli":
            return {"running": False, "version": None, "error": "docker is not installed", "image": None}
        if text.startswith("server=") and rc == 0:
            image = next((ln[6:] for ln in lines[1:] if ln.startswith("image=")), None)
            return {"running": True, "version": text[7:], "error": None, "image": image}
        return {"running": False, "version": None, "image": None,
                "error": text or err.strip() or f"docker info failed (rc={rc})"}


SMOKE_DIR = "~/.cache/sparkprov/gpu-smoke"  # passed GPU smoke tests, one file per what they depend on


@dataclass(frozen=True)
class GpuSmokeRecord(Fact):
    """Whether `docker run --rm --gpus all IMAGE COMMAND` passed for this image build, docker
    server and driver (a record the smoke change writes): a read, never a container. The key
    changes with any of them, so a new driver or image is smoke-tested again."""

    image: str
    command_argv: tuple[str, ...] = ()
    gpus: bool = True

    def command(self, sh: ShellCtx) -> str:
        return ("docker info >/dev/null 2>&1 || { echo @noaccess; exit 0; }\n"
                f"i=$({cmd('docker', 'image', 'inspect', '--format', '{{.Id}}', self.image)} 2>/dev/null) || {{ echo @absent; exit 0; }}\n"
                "v=$(docker version --format '{{.Server.Version}}' 2>/dev/null)\n"
                "d=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)\n"
                f"k=$(printf '%s|%s|%s|%s|%s' \"$i\" \"$v\" \"$d\" {quote(' '.join(self.command_argv))} {int(self.gpus)} "
                "| sha256sum | cut -c1-32)\n"
                f"echo \"@key $k\"; f={sh.path(SMOKE_DIR)}/\"$k\"; [ -f \"$f\" ] && echo @passed; true")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        text = out.strip()
        if text in ("@noaccess", "@absent"):
            return {"state": text[1:], "key": None, "passed": False}
        m = re.search(r"@key ([0-9a-f]{32})", out)
        if not m:
            raise FactError(f"unexpected smoke record output: {text[:200]!r}")
        return {"state": "present", "key": m.group(1), "passed": "@passed" in out}


# ---------------------------------------------------------------------------------------------
# Ollama (G14)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OllamaState(Fact):
    """What an Ollama server at URL holds in memory (GET /api/ps)."""

    url: str = "http://127.0.0.1:11434"

    def command(self, sh: ShellCtx) -> str:
        u = quote(self.url.rstrip("/") + "/api/ps")
        return (f"if command -v curl >/dev/null 2>&1; then curl -s -m 3 --noproxy '*' {u}; "
                f"else python3 -c 'import sys,urllib.request as u;print(u.build_opener(u.ProxyHandler({{}})).open(sys.argv[1],timeout=3).read().decode())' {u} 2>/dev/null; fi; "
                "echo; echo \"@rc=$?\"")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_ollama_ps(out)


def parse_ollama_ps(out: str) -> dict[str, Any]:
    body = re.sub(r"@rc=\d+\s*$", "", out).strip()
    if not body:
        return {"running": False, "models": []}
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return {"running": False, "models": [], "error": body[:200]}
    models = [{"name": m.get("name") or m.get("model"), "size": m.get("size"), "size_vram": m.get("size_vram"),
               "expires_at": m.get("expires_at")} for m in data.get("models") or []]
    return {"running": True, "models": models}
