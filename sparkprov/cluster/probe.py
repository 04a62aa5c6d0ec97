"""The HTTP probe that runs on a serving host (python3, standard library only), talking to vLLM on
that host. The API key is read there from its 0600 file: it never crosses the SSH link, never
reaches an argv (the probe program itself travels in the script on stdin).

Modes (one JSON document on stdout):
    state      GET /health, /v1/models, /metrics    -> {health, models, metrics, error}
    smoke      warm-up request, then the smoke request -> {warmup, smoke: {content, reasoning, finish, ...}}
"""

from __future__ import annotations

import json
import re
from typing import Any

from sparkprov.transport.shell import quote

PROGRAM = r'''
import json, sys, time, urllib.request, urllib.error
mode, base, keyfile = sys.argv[1], sys.argv[2], sys.argv[3]
spec = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
key = None
if keyfile != "-":
    try:
        with open(keyfile) as fh:
            key = fh.read().strip() or None
    except OSError as e:
        key = None
def call(path, body=None, timeout=10):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode())
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", "Bearer " + key)
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")[:500]
    except Exception as e:
        return None, "%s: %s" % (type(e).__name__, e)
out = {}
if mode == "state":
    st, body = call("/health", timeout=5)
    out["health"] = st
    out["error"] = None if st == 200 else body[:300]
    if st == 200:
        st, body = call("/v1/models")
        try:
            out["models"] = [m["id"] for m in json.loads(body)["data"]] if st == 200 else None
        except Exception:
            out["models"] = None
        if st != 200:
            out["models_error"] = "%s %s" % (st, body[:200])
        if spec.get("metrics"):
            st, body = call("/metrics")
            out["metrics"] = body if st == 200 else None
elif mode == "smoke":
    model = spec["model"]
    t0 = time.time()
    st, body = call("/v1/chat/completions", {"model": model, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "chat_template_kwargs": spec["kwargs"]}, timeout=spec.get("timeout", 600))
    out["warmup"] = {"status": st, "seconds": round(time.time() - t0, 2), "error": None if st == 200 else body[:300]}
    t0 = time.time()
    st, body = call("/v1/chat/completions", {"model": model, "max_tokens": spec["max_tokens"], "temperature": 0,
                    "messages": [{"role": "user", "content": spec["prompt"]}],
                    "chat_template_kwargs": spec["kwargs"]}, timeout=spec.get("timeout", 600))
    res = {"status": st, "seconds": round(time.time() - t0, 2)}
    if st == 200:
        try:
            choice = json.loads(body)["choices"][0]
            msg = choice.get("message") or {}
            res.update(content=msg.get("content"), reasoning=msg.get("reasoning_content") or msg.get("reasoning"),
                       finish=choice.get("finish_reason"))
        except Exception as e:
            res["error"] = "unreadable reply: %s" % body[:300]
    else:
        res["error"] = body[:300]
    out["smoke"] = res
print(json.dumps(out))
'''


def script(mode: str, base_url: str, keyfile: str | None, spec: dict | None = None) -> str:
    """Shell text that runs the probe on the host. `keyfile` may start with ~/ (the login home)."""
    kf = "-" if not keyfile else keyfile
    if kf.startswith("~/"):
        kf_word = '"$HOME"' + quote(kf[1:])
    else:
        kf_word = quote(kf)
    args = " ".join([quote(mode), quote(base_url), kf_word] + ([quote(json.dumps(spec))] if spec is not None else []))
    return f"python3 - {args} <<'SPARKPROV_PROBE'\n{PROGRAM}\nSPARKPROV_PROBE\n"


def parse(out: str) -> dict[str, Any]:
    for line in reversed(out.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no probe output: {out.strip()[:200]!r}")


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEnaNInf]+)$')


def metrics(text: str | None) -> dict[str, Any]:
    """KV-cache usage and speculative-decoding acceptance from vLLM's /metrics (summed over engines)."""
    if not text:
        return {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        try:
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            continue
    out: dict[str, Any] = {}
    kv = sums.get("vllm:kv_cache_usage_perc", sums.get("vllm:gpu_cache_usage_perc"))
    if kv is not None:
        out["kv_cache_usage"] = kv
    for k, name in (("vllm:num_requests_running", "running"), ("vllm:num_requests_waiting", "waiting"),
                    ("vllm:generation_tokens_total", "generation_tokens")):
        if k in sums:
            out[name] = sums[k]
    drafted = sums.get("vllm:spec_decode_num_draft_tokens_total")
    accepted = sums.get("vllm:spec_decode_num_accepted_tokens_total")
    drafts = sums.get("vllm:spec_decode_num_drafts_total")
    if drafted is not None and accepted is not None:
        out["spec_acceptance"] = (accepted / drafted) if drafted else None
        out["spec_mean_accepted_length"] = (1 + accepted / drafts) if drafts else None
    return out
