"""The HTTP probe that runs on a serving host, talking to vLLM on that host: the program is
sparkprov/node/probe.py (standard library only), its text sent in the script on stdin. The API key is
read there from its 0600 file: it never crosses the SSH link, never reaches an argv.

Modes (one JSON document on stdout):
    state      GET /health, /v1/models, /metrics    -> {health, models, metrics, error}
    ready      wait for the container's engine (Ray nodes, /health), warm up, ask the smoke
               question, record the answer under the container ID -> {smoke | failed, ...}
    status     every sparkprov container with labels and state, and each server's probe
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sparkprov.node import probe as node_probe
from sparkprov.node.probe import FAILED_STARTS_DIR, LIVENESS_TIMEOUT_S, cause_lines, why_stopped  # noqa: F401
from sparkprov.transport.shell import quote

# The program's text: its file (code that runs on nodes lives in sparkprov/node), sent as it is.
PROGRAM = Path(node_probe.__file__).read_text()


def program() -> str:
    """The probe's Python text."""
    return PROGRAM


def script(mode: str, base_url: str, keyfile: str | None, spec: dict | None = None) -> str:
    """Shell text that runs the probe on the host. `keyfile` may start with ~/ (the login home)."""
    kf = "-" if not keyfile else keyfile
    if kf.startswith("~/"):
        kf_word = '"$HOME"' + quote(kf[1:])
    else:
        kf_word = quote(kf)
    args = " ".join([quote(mode), quote(base_url), kf_word] + ([quote(json.dumps(spec))] if spec is not None else []))
    return f"python3 - {args} <<'SPARKPROV_PROBE'\n{program()}\nSPARKPROV_PROBE\n"


def status_script() -> str:
    """Every sparkprov container of the host, probed on the host (the key files are read there)."""
    return script("status", "-", None)


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
