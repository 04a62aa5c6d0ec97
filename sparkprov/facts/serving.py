"""Facts cluster-up, cluster-down and status read, all in the one gather per host."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sparkprov.facts import probe
from sparkprov.facts.docker_run import reporting_cause
from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.imageref import ImageRef
from sparkprov.node import ondemand
from sparkprov.transport.shell import cmd, quote

MANAGED = "sparkprov.managed"
FORMAT = ("{{.Name}}\t{{.Id}}\t{{.Image}}\t{{.Config.Image}}\t{{.State.Status}}\t{{.State.ExitCode}}\t"
          "{{.RestartCount}}\t{{.State.StartedAt}}\t{{json .Config.Labels}}")


def parse_containers(out: str) -> dict[str, Any]:
    text = out.strip()
    if text.startswith("@noaccess"):
        return {"access": False, "error": text[len("@noaccess"):].strip() or "docker is not reachable", "containers": []}
    items = []
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) != 9:
            continue
        name, cid, image_id, image, status, code, restarts, started, labels = parts
        items.append({"name": name.lstrip("/"), "id": cid, "image_id": image_id, "image": image, "status": status,
                      "exit_code": int(code), "restarts": int(restarts), "started": started,
                      "labels": json.loads(labels) or {}})
    return {"access": True, "error": None, "containers": items}


@dataclass(frozen=True)
class ManagedContainers(Fact):
    """Every container with the label sparkprov.managed=1 (running or not), with its labels."""

    def command(self, sh: ShellCtx) -> str:
        # docker's own reason (daemon down, socket permission), not the blank or heading lines
        # its client prints around it.
        return ("o=$(docker info --format '{{.ServerVersion}}' 2>&1) || { w=$(printf '%s\\n' \"$o\" | "
                "grep -m1 -iE 'cannot|denied|error|not found'); [ -n \"$w\" ] || w=$(printf '%s\\n' \"$o\" | "
                "sed -n '/[^[:space:]]/{p;q}'); printf '@noaccess %s\\n' \"$w\"; exit 0; }\n"
                f"ids=$(docker ps -aq --filter {quote('label=' + MANAGED + '=1')})\n"
                f"[ -z \"$ids\" ] || docker inspect --format {quote(FORMAT)} $ids")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        if rc != 0:
            raise FactError(err.strip() or f"docker inspect failed (rc={rc})")
        return parse_containers(out)


@dataclass(frozen=True)
class ImageId(Fact):
    """The local image ID of a reference, or None when the daemon does not have it."""

    image: str

    def command(self, sh: ShellCtx) -> str:
        return (f"if o=$({cmd('docker', 'image', 'inspect', '--format', '{{.Id}}', self.image)} 2>&1); then echo \"id=$o\"; "
                "else case \"$o\" in *'No such'*|*'not found'*) echo absent;; *) printf 'error=%s\\n' \"$(printf '%s' \"$o\" | head -n 1)\";; esac; fi")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        line = out.strip().splitlines()[0] if out.strip() else ""
        if line.startswith("id="):
            return {"id": line[3:].strip(), "error": None}
        if line == "absent":
            return {"id": None, "error": None}
        return {"id": None, "error": line[6:] if line.startswith("error=") else (err.strip() or "docker image inspect failed")}


@dataclass(frozen=True)
class KeyFile(Fact):
    """The API key file: exists, non-empty, its mode and owner (never its content)."""

    path: str

    def command(self, sh: ShellCtx) -> str:
        p = sh.path(self.path)
        return f"p={p}\nif [ -f \"$p\" ]; then stat -c 'mode=%a owner=%U size=%s' -- \"$p\"; else echo absent; fi"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        text = out.strip()
        if text == "absent" or not text:
            return {"exists": False}
        kv = dict(w.split("=", 1) for w in text.split())
        return {"exists": True, "mode": int(kv["mode"], 8), "owner": kv["owner"], "size": int(kv["size"])}


@dataclass(frozen=True)
class KeyText(Fact):
    """The content of an API key file, for the gateway that must present it (None: absent or
    unreadable). A secret: it stays in the run's memory (its repr names the path only), reaches
    no report, and travels to the gateway host inside a script on stdin, never in an argv."""

    path: str

    def command(self, sh: ShellCtx) -> str:
        p = sh.path(self.path)
        return f'p={p}\nif [ -f "$p" ] && [ -r "$p" ]; then printf "@key "; head -c 4096 -- "$p"; echo; else echo absent; fi'

    def parse(self, out: str, err: str, rc: int) -> str | None:
        line = out.strip()
        return line[5:].strip() or None if line.startswith("@key ") else None


@dataclass(frozen=True)
class Listeners(Fact):
    """Which of these TCP ports something listens on (any address), from /proc/net/tcp{,6}."""

    ports: tuple[int, ...]

    def command(self, sh: ShellCtx) -> str:
        return "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk '$4==\"0A\" {split($2,a,\":\"); print a[2]}' | sort -u"

    def parse(self, out: str, err: str, rc: int) -> list[int]:
        found = {int(x, 16) for x in out.split() if re.fullmatch(r"[0-9A-Fa-f]{4}", x)}
        return sorted(p for p in self.ports if p in found)


@dataclass(frozen=True)
class ServerState(Fact):
    """vLLM on this host answering at BASE: /health, /v1/models and (metrics=True) /metrics."""

    base: str
    keyfile: str | None = None
    with_metrics: bool = False

    def command(self, sh: ShellCtx) -> str:
        kf = self.keyfile
        if kf and (kf == "~" or kf.startswith("~/")) and sh.home:
            kf = sh.home.rstrip("/") + kf[1:]
        return probe.script("state", self.base, kf, {"metrics": self.with_metrics})

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        try:
            return probe.parse(out)
        except ValueError:
            raise FactError(f"probe of {self.base} failed: {(err.strip() or out.strip())[:200]}") from None


_RAY_NODES = re.compile(r"^\s*1\s+(node_[0-9a-f]+)\s*$", re.M)
_RAY_GPU = re.compile(r"^\s*([0-9.]+)/([0-9.]+)\s+GPU\b", re.M)


def parse_ray_status(text: str) -> dict[str, Any]:
    """`ray status` (see gb10-outputs.md): active nodes and GPUs used/total."""
    active = text.split("Active:", 1)[1] if "Active:" in text else ""
    active = re.split(r"^\s*(Pending|Recent failures):", active, maxsplit=1, flags=re.M)[0]
    nodes = _RAY_NODES.findall(active)
    m = _RAY_GPU.search(text)
    return {"ok": "Active:" in text, "nodes": len(nodes), "node_ids": nodes,
            "gpus_used": float(m.group(1)) if m else 0.0, "gpus": float(m.group(2)) if m else 0.0}


SMOKE_DIR = "~/.cache/sparkprov/smoke"  # per container ID: the smoke test's answer (JSON)


@dataclass(frozen=True)
class ServeReady(Fact):
    """The serving container of a deployment on this host: its ID, state and restarts, /health
    and the served models (when running), the end of its log (when not), and the smoke-test
    answer recorded for this container ID (None: not smoke-tested since it was created)."""

    container: str
    base: str
    keyfile: str | None = None

    def command(self, sh: ShellCtx) -> str:
        name = quote(self.container)
        return (f"if s=$(docker inspect --format '{{{{.Id}}}} {{{{.State.Status}}}} {{{{.RestartCount}}}}' {name} 2>/dev/null); "
                "then echo \"@c $s\"; else echo '@c - absent 0'; fi\n"
                f"set -- $(docker inspect --format '{{{{.Id}}}}' {name} 2>/dev/null) -\n"
                f"m={sh.path(SMOKE_DIR)}/\"$1\".json\n"
                "if [ \"$1\" != - ] && [ -f \"$m\" ]; then printf '@smoke '; head -c 4000 \"$m\"; echo; fi\n"
                f"if [ \"$(docker inspect --format '{{{{.State.Status}}}}' {name} 2>/dev/null)\" = running ]; then\n"
                + ServerState(self.base, self.keyfile).command(sh) +
                f"\nelse echo '@logs'; docker logs --tail 300 {name} 2>&1 | tail -n 300; fi")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        res: dict[str, Any] = {"id": None, "status": "absent", "restarts": 0, "smoke": None, "health": None,
                               "models": None, "logs": ""}
        lines = out.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("@c "):
                cid, status, restarts = (line[3:].split() + ["0", "0"])[:3]
                res.update(id=None if cid == "-" else cid, status=status, restarts=int(restarts))
            elif line.startswith("@smoke "):
                try:
                    res["smoke"] = json.loads(line[7:])
                except ValueError:
                    res["smoke"] = {"error": "unreadable smoke record"}
            elif line.startswith("@logs"):
                res["logs"] = "\n".join(lines[i + 1:]).strip()
                break
            elif line.startswith("{"):
                st = json.loads(line)
                res.update(health=st.get("health"), models=st.get("models"), error=st.get("error"))
        return res


@dataclass(frozen=True)
class ServingStatus(Fact):
    """Every sparkprov container on the host with its labels and state; for the running ones that
    serve, /health, the models and /metrics; for a running Ray head, `ray status`."""

    def command(self, sh: ShellCtx) -> str:
        return probe.status_script()

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        try:
            doc = probe.parse(out)
        except ValueError:
            raise FactError(f"status probe failed: {(err.strip() or out.strip())[:200]}") from None
        if doc.get("access"):
            for c in doc["containers"]:
                if c.get("ray_text") is not None:
                    c["ray"] = parse_ray_status(c.pop("ray_text"))
                c["metrics"] = probe.metrics(c.pop("metrics_text", None))
                if ondemand.is_on_demand(c):  # parked, starting or serving (issue 35)
                    c["on_demand"] = ondemand.state(c, c.get("health"))
        return doc


@dataclass(frozen=True)
class ImageLabel(Fact):
    """An image's ID and the value of one of its labels (None when the daemon does not have it)."""

    image: str
    label: str

    def command(self, sh: ShellCtx) -> str:
        fmt = "{{.Id}} {{index .Config.Labels " + json.dumps(self.label) + "}}"
        return f"{cmd('docker', 'image', 'inspect', '--format', fmt, self.image)} 2>/dev/null || echo absent"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        words = out.split()
        if not words or words[0] == "absent":
            return {"id": None, "label": None}
        value = words[1] if len(words) > 1 and words[1] != "<no" else None
        return {"id": words[0], "label": value}


_DIGEST_MARK = "SPARKPROV_DIGEST"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def digest_script(refs: list[str]) -> str:
    """POSIX sh printing `MARK REF DIGEST` for every image present on the host (nothing is pulled)."""
    lines = []
    for ref in refs:
        repo = ImageRef.parse(ref).name
        lines.append(f"for d in $(docker image inspect --format '{{{{range .RepoDigests}}}}{{{{println .}}}}{{{{end}}}}' "
                     f"{cmd(ref)} 2>/dev/null); do case \"$d\" in {cmd(repo)}@*) echo {_DIGEST_MARK} {cmd(ref)} \"${{d#*@}}\";; "
                     f"esac; done")
    return "\n".join(lines) + "\n"


def parse_digests(stdout: str) -> dict[str, str]:
    """{ref: sha256:...} from digest_script output (the first digest per ref)."""
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == _DIGEST_MARK and _DIGEST_RE.match(parts[2]):
            out.setdefault(parts[1], parts[2])
    return out


def help_script(image: str) -> str:
    """POSIX sh that prints the image's own `vllm serve --help=all` (no GPU, no network)."""
    return reporting_cause(cmd("docker", "run", "--rm", "--network", "none", "--entrypoint", "vllm", image, "serve",
                               "--help=all")) + "\n"




@dataclass(frozen=True)
class ImageDigests(Fact):
    """The registry digest each of these tags resolved to on this host (the ones present; nothing
    is pulled)."""

    refs: tuple[str, ...]

    def command(self, sh: ShellCtx) -> str:
        return digest_script(list(self.refs)) + "true"

    def parse(self, out: str, err: str, rc: int) -> dict[str, str]:
        return parse_digests(out)


VIEW_BYTES = 256 * 1024  # the hook's view: a few hundred bytes per deployment and its last 20 events


@dataclass(frozen=True)
class OnDemandView(Fact):
    """The gateway hook's view of the on-demand deployments, as it last wrote it on the gateway's
    host (serving/gateway_hook.py: state, requests in flight, idle_s, as of `written`), with this
    host's clock: {"now": epoch, "view": the document or None (no gateway with on-demand
    deployments here, or a file that is no view)}."""

    path: str

    def command(self, sh: ShellCtx) -> str:
        p = sh.path(self.path)
        return f'date +%s\np={p}\n[ -f "$p" ] && head -c {VIEW_BYTES} "$p"; echo'

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        head, _, rest = out.partition("\n")
        try:
            now = float(head.strip())
        except ValueError:
            raise FactError(f"no clock in {out[:100]!r}") from None
        try:
            view = json.loads(rest) if rest.strip() else None
        except ValueError:
            view = None
        ok = isinstance(view, dict) and isinstance(view.get("deployments"), dict) \
            and isinstance(view.get("written"), (int, float))
        return {"now": now, "view": view if ok else None}

