"""`vllm bench serve` for the lab image: vLLM's benchmark client, its flag names and its result
file's names (vllm/benchmarks/serve.py), against the lab engine over real HTTP.

The real client lives in every vLLM image; the lab image has no vLLM, so this stands in for it.
It does what the real one does with the flags sparkprov passes: random prompts of
--random-input-len tokens (the lab engine counts words), streamed chat completions with
ignore_eos and --random-output-len, --max-concurrency requests in flight, the key from
OPENAI_API_KEY; it measures TTFT, TPOT, ITL and E2E per request and writes the result JSON.
A server that refuses or fails requests shows up as `failed`, as in vLLM's client.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm bench serve")
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat", "vllm"])
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true")
    return p


WORDS = ("spark grace blackwell unified memory tensor parallel fabric kernel cache prefill decode "
         "token stream model weights rank node link").split()


def one_request(conn_args, path, headers, model, prompt, out_len, ignore_eos) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": out_len,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    res = {"success": False, "ttft": 0.0, "itl": [], "latency": 0.0, "output_tokens": 0, "prompt_len": 0,
           "error": ""}
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(*conn_args, timeout=600)
        conn.request("POST", path, json.dumps(body), {**headers, "Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read().decode('utf-8', 'replace')[:200]}"
            return res
        last = t0
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                res["output_tokens"] = chunk["usage"].get("completion_tokens", 0)
                res["prompt_len"] = chunk["usage"].get("prompt_tokens", 0)
            for ch in chunk.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if not res["ttft"]:
                        res["ttft"] = now - t0
                    else:
                        res["itl"].append(now - last)
                    last = now
        res["latency"] = time.perf_counter() - t0
        res["success"] = bool(res["ttft"])
        if not res["success"]:
            res["error"] = "no token came back"
    except Exception as e:  # a dropped connection is a failed request, as in vLLM's client
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def pct(values: list[float], p: float) -> float:
    """numpy.percentile's default (linear) interpolation."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    base = a.base_url or f"http://{a.host}:{a.port}"
    u = urlsplit(base)
    conn_args = (u.hostname, u.port or 80)
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    rng = random.Random(a.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(a.random_input_len)) for _ in range(a.num_prompts)]
    model = a.served_model_name or a.model
    conc = a.max_concurrency or a.num_prompts
    # vLLM's client tries one request first and stops there when it fails
    first = one_request(conn_args, a.endpoint, headers, model, prompts[0], a.random_output_len, a.ignore_eos)
    if not first["success"]:
        print("ValueError: Initial test run failed - Please make sure benchmark arguments are correctly "
              f"specified. Error: {first['error']}", file=sys.stderr)
        return 1
    print(f"Maximum request concurrency: {a.max_concurrency}", flush=True)
    t0 = time.perf_counter()
    lock = threading.Lock()
    results: list[dict] = []

    def go(prompt):
        r = one_request(conn_args, a.endpoint, headers, model, prompt, a.random_output_len, a.ignore_eos)
        with lock:
            results.append(r)

    with ThreadPoolExecutor(max_workers=conc) as pool:
        list(pool.map(go, prompts))
    duration = time.perf_counter() - t0
    ok = [r for r in results if r["success"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_len"] for r in ok)
    ms = {"ttft": [r["ttft"] * 1000 for r in ok], "e2el": [r["latency"] * 1000 for r in ok],
          "itl": [x * 1000 for r in ok for x in r["itl"]],
          "tpot": [(r["latency"] - r["ttft"]) * 1000 / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]}
    doc = {"date": time.strftime("%Y%m%d-%H%M%S"), "endpoint_type": a.backend, "backend": a.backend, "label": a.label,
           "model_id": a.model, "tokenizer_id": a.tokenizer or a.model, "num_prompts": a.num_prompts,
           "request_rate": "inf" if a.request_rate == float("inf") else a.request_rate, "burstiness": 1.0,
           "max_concurrency": a.max_concurrency, "duration": duration, "completed": len(ok),
           "failed": len(results) - len(ok), "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
           "request_throughput": len(ok) / duration, "request_goodput": None,
           "output_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
           "errors": [r["error"] for r in results]}
    for m in [x.strip() for x in a.percentile_metrics.split(",") if x.strip()]:
        vals = ms.get(m, [])
        doc[f"mean_{m}_ms"] = statistics.fmean(vals) if vals else 0.0
        doc[f"median_{m}_ms"] = statistics.median(vals) if vals else 0.0
        doc[f"std_{m}_ms"] = statistics.pstdev(vals) if vals else 0.0
        for p in [float(x) for x in a.metric_percentiles.split(",") if x.strip()]:
            doc[f"p{p:g}_{m}_ms"] = pct(vals, p)
    print(f"Successful requests: {len(ok)}\nFailed requests: {len(results) - len(ok)}\n"
          f"Output token throughput (tok/s): {doc['output_throughput']:.2f}", flush=True)
    if not ok:
        errs = sorted({r["error"] for r in results})[:3]
        print("All requests failed: " + " | ".join(errs), file=sys.stderr)
    if a.save_result:
        name = a.result_filename or f"{a.backend}-{a.request_rate}qps-{a.model.split('/')[-1]}-{doc['date']}.json"
        path = os.path.join(a.result_dir, name) if a.result_dir else name
        if a.result_dir:
            os.makedirs(a.result_dir, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(doc, fh)
    return 0
