"""The HTTP probe that runs on a serving host, talking to vLLM on that host: sparkprov/facts/probe.py
sends this file's text over SSH (`python3 - MODE BASE KEYFILE [SPEC] <<heredoc`). The API key is
read here from its 0600 file: it never crosses the SSH link, never reaches an argv.

Modes (one JSON document on stdout):
    state      GET /health, /v1/models, /metrics    -> {health, models, metrics, error}
    ready      wait for the container's engine (Ray nodes, /health), warm up, ask the smoke
               question, record the answer under the container ID -> {smoke | failed, ...}
    status     every sparkprov container with labels and state, and each server's probe
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

# Where the ready probe keeps the whole log of a start that failed (the container is removed again).
FAILED_STARTS_DIR = "~/.cache/sparkprov/failed-starts"
# Seconds the status probe waits for its one token: a request queued behind a full batch still
# gets its first token in this time on a live engine; a lost rank makes it fail or hang.
LIVENESS_TIMEOUT_S = 15

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read_key(path: str | None) -> str | None:
    """The API key in `path` (~ is the home of who runs this), or None."""
    if not path or path == "-":
        return None
    try:
        with open(os.path.expanduser(path)) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def call(base: str, path: str, key: str | None, body: dict | None = None, timeout: float = 10) -> tuple[int | None, str]:
    """One HTTP request to vLLM: (status, body); status None when there was no answer (the body says why)."""
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode())
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", "Bearer " + key)
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")[:500]
    except Exception as e:
        return None, "%s: %s" % (type(e).__name__, e)


def one_token(base: str, model: str, key: str | None, timeout: float) -> dict:
    """Liveness: one generated token (/v1/completions, max_tokens 1): status, seconds, error."""
    t0 = time.time()
    st, body = call(base, "/v1/completions", key, {"model": model, "prompt": "1", "max_tokens": 1, "temperature": 0},
                    timeout)
    return {"status": st, "seconds": round(time.time() - t0, 2), "error": None if st == 200 else (body or "")[:200]}


def cause_lines(text: str, limit: int = 2) -> list[str]:
    """The lines of a vLLM container's log that say why it stopped: the first error (a worker that
    died, an ERROR line, an exception) and the last exception, vLLM's log prefix dropped."""
    prefix = re.compile(r"^\((\w+)[^)]*\) (\w+) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] ?")
    exception = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b: ")
    generic = ("Dumping ", "EngineCore encountered a fatal error", "EngineCore failed to start")
    first, last, in_traceback = None, None, False
    for raw in text.splitlines():
        m = prefix.match(raw)
        level = m.group(2) if m else ""
        line = (raw[m.end():] if m else raw).strip()
        if line.startswith("Traceback"):
            in_traceback = True   # its frames say where, the exception line that ends it says what
            continue
        if exception.match(line):
            in_traceback, last = False, line
            first = first or line
            continue
        if in_traceback or not line or line.startswith(generic):
            continue
        if first is None and (level in ("ERROR", "CRITICAL") or line.startswith(
                ("sparkprov-supervise:", "sparkprov:", "Killed"))):
            first = line
    found = [first] if first else []
    if last and last != first:
        found.append(last)
    return [(f if len(f) <= 240 else f[:237] + "...") for f in found[:limit]]


def why_stopped(logs: str | None) -> str:
    """What a stopped container's log says of why: its cause lines, else (no cause in it) its last
    lines (after a dead engine the last lines are vLLM's shutdown, which says nothing of why)."""
    cause = cause_lines(logs or "")
    if cause:
        return " / ".join(cause)
    lines = [ln for ln in (logs or "").strip().splitlines() if ln.strip()]
    return "its log ends: " + (" / ".join(lines[-3:])[-400:] if lines else "(empty)")


def state(base: str, key: str | None, spec: dict) -> dict:
    out: dict = {}
    st, body = call(base, "/health", key, timeout=5)
    out["health"] = st
    out["error"] = None if st == 200 else body[:300]
    if st == 200:
        st, body = call(base, "/v1/models", key)
        try:
            out["models"] = [m["id"] for m in json.loads(body)["data"]] if st == 200 else None
        except Exception:
            out["models"] = None
        if st != 200:
            out["models_error"] = "%s %s" % (st, body[:200])
        if spec.get("metrics"):
            st, body = call(base, "/metrics", key)
            out["metrics"] = body if st == 200 else None
    return out


# Long on purpose: one bounded wait whose phases (container, Ray, /health, warm-up, smoke) share its
# deadline and last reading; it runs on the node as one call.
def ready(base: str, key: str | None, spec: dict) -> dict:
    """Wait (bounded) for the engine: the container keeps running, Ray sees every node's GPU
    (executor ray), /health answers; then warm up and ask the smoke question. Progress on stderr;
    the answer is recorded under the container's ID."""
    name, deadline = spec["container"], time.time() + spec["timeout"]

    def inspect() -> list[str]:
        r = subprocess.run(["docker", "inspect", "--format", "{{.Id}} {{.State.Status}} {{.RestartCount}}", name],
                           capture_output=True, text=True)
        return (r.stdout.split() + ["-", "absent", "0"])[:3] if r.returncode == 0 else ["-", "absent", "0"]

    def logs() -> str:
        # why it stopped (the cause lines of the whole log, not its last lines: after a dead engine
        # those are vLLM's shutdown), and the whole log kept on the host, since a failed start is
        # removed again
        r = subprocess.run(["docker", "logs", "--tail", "5000", name], capture_output=True, text=True)
        text = r.stdout + r.stderr
        why, kept = why_stopped(text), "%s-%s.log" % (name, cid[:12])
        try:
            d = os.path.expanduser(FAILED_STARTS_DIR)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, kept), "w") as fh:
                fh.write(text)
            return "%s (its whole log: %s/%s)" % (why, FAILED_STARTS_DIR, kept)
        except OSError:
            return why

    cid, status, restarts0 = inspect()
    out: dict = {"container": name, "id": cid}
    phase, last = "start", ""
    while True:
        cid2, status, restarts = inspect()
        if status != "running" or restarts != restarts0 or cid2 != cid:
            out.update(failed="%s is %s (restarts %s) while loading: %s" % (
                name, "restarting" if status == "running" else status, restarts, logs() or "(empty)"))
            break
        if time.time() > deadline:
            out.update(failed="timed out after %ds waiting for %s (%s): %s" % (
                spec["timeout"], phase, last or "no answer", logs() or "(empty)"))
            break
        if spec.get("ray_gpus"):
            phase = "Ray to see %d nodes and GPUs" % spec["ray_gpus"]
            r = subprocess.run(["docker", "exec", name, "ray", "status"], capture_output=True, text=True)
            act = r.stdout.split("Active:", 1)[1] if "Active:" in r.stdout else ""
            act = act.split("Pending:", 1)[0]
            nodes = sum(1 for ln in act.splitlines() if ln.strip().startswith("1 node_"))
            gpus = 0.0
            for ln in r.stdout.splitlines():
                w = ln.split()
                if len(w) >= 2 and w[1] == "GPU" and "/" in w[0]:
                    gpus = float(w[0].split("/")[1])
            last = "%d/%d nodes, %g/%d GPUs" % (nodes, spec["ray_gpus"], gpus, spec["ray_gpus"])
            if nodes < spec["ray_gpus"] or gpus < spec["ray_gpus"]:
                time.sleep(2)
                continue
            out["ray"] = last
        phase = "/health"
        st, body = call(base, "/health", key, timeout=5)
        last = "HTTP %s" % st if st else body[:120]
        if st == 200:
            break
        time.sleep(2)
    if "failed" in out:
        return out
    out["health_after_s"] = round(spec["timeout"] - (deadline - time.time()), 1)
    model = spec["model"]
    t0 = time.time()
    st, body = call(base, "/v1/chat/completions", key, {"model": model, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "chat_template_kwargs": spec["kwargs"]}, timeout=spec.get("smoke_timeout", 600))
    out["warmup"] = {"status": st, "seconds": round(time.time() - t0, 2), "error": None if st == 200 else body[:300]}
    t0 = time.time()
    st, body = call(base, "/v1/chat/completions", key, {"model": model, "max_tokens": spec["max_tokens"],
                    "temperature": 0, "messages": [{"role": "user", "content": spec["prompt"]}],
                    "chat_template_kwargs": spec["kwargs"]}, timeout=spec.get("smoke_timeout", 600))
    res: dict = {"status": st, "seconds": round(time.time() - t0, 2), "prompt": spec["prompt"]}
    if st == 200:
        try:
            choice = json.loads(body)["choices"][0]
            msg = choice.get("message") or {}
            res.update(content=msg.get("content"), reasoning=bool(msg.get("reasoning_content") or msg.get("reasoning")),
                       finish=choice.get("finish_reason"))
        except Exception:
            res["error"] = "unreadable reply: %s" % body[:300]
    else:
        res["error"] = body[:300]
    res["warmup"] = out["warmup"]
    out["smoke"] = res
    d = os.path.expanduser(spec["record_dir"])
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, cid + ".json"), "w") as fh:
        json.dump(res, fh)
    return out


def status() -> dict:
    """Every sparkprov container (labels, state, restarts) and, for each that serves the API, its
    /health, models, /metrics and one generated token."""
    out: dict = {}
    fmt = ("{{.Name}}\t{{.Id}}\t{{.State.Status}}\t{{.State.ExitCode}}\t{{.RestartCount}}\t"
           "{{.State.StartedAt}}\t{{json .Config.Labels}}\t{{.Config.Image}}")
    r = subprocess.run(["docker", "ps", "-aq", "--filter", "label=sparkprov.managed=1"], capture_output=True, text=True)
    out["access"] = r.returncode == 0
    out["error"] = None if r.returncode == 0 else ([ln for ln in r.stderr.splitlines() if ln.strip()]
                                                   or ["docker failed"])[-1]
    out["containers"] = []
    ids = r.stdout.split()
    if not ids:
        return out
    r = subprocess.run(["docker", "inspect", "--format", fmt] + ids, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        p = line.split("\t")
        if len(p) != 8:
            continue
        labels = json.loads(p[6]) or {}
        c = {"name": p[0].lstrip("/"), "id": p[1], "status": p[2], "exit_code": int(p[3]),
             "restarts": int(p[4]), "started": p[5], "labels": labels, "image": p[7]}
        port = labels.get("sparkprov.port")
        if c["status"] == "running" and port:
            key = read_key(labels.get("sparkprov.api_key_file"))
            base = "http://127.0.0.1:" + port
            c["port"] = int(port)
            c["health"], _ = call(base, "/health", key, timeout=5)
            st, body = call(base, "/v1/models", key, timeout=5)
            try:
                c["served_models"] = [m["id"] for m in json.loads(body)["data"]] if st == 200 else []
            except Exception:
                c["served_models"] = []
            st, body = call(base, "/metrics", key, timeout=5)
            c["metrics_text"] = body if st == 200 else None
            if c["health"] == 200:  # (only the containers that serve the API have a port label)
                # liveness is a token generated, not /health: with a rank lost, /health stays
                # 200 until a request fails (docs/real-vllm.md)
                model = labels.get("sparkprov.model") or (c["served_models"] or ["?"])[0]
                c["liveness"] = one_token(base, model, key, LIVENESS_TIMEOUT_S)
        if c["status"] == "running" and labels.get("sparkprov.role") == "ray-head":
            rr = subprocess.run(["docker", "exec", c["name"], "ray", "status"], capture_output=True, text=True)
            c["ray_text"] = rr.stdout
        out["containers"].append(c)
    return out


def main(argv: list[str]) -> None:
    mode, base, keyfile = argv[0], argv[1], argv[2]
    spec = json.loads(argv[3]) if len(argv) > 3 else {}
    key = read_key(keyfile)
    if mode == "state":
        out = state(base, key, spec)
    elif mode == "ready":
        out = ready(base, key, spec)
    elif mode == "status":
        out = status()
    else:
        out = {"error": "unknown mode %r" % mode}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
