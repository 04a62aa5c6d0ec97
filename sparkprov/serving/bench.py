"""`invoke bench`: vLLM's own benchmark client (`vllm bench serve`) against a deployment, and what
sparkprov keeps of it.

Why vLLM's client and not llama-benchy or aiperf: it is in every image sparkprov serves (same
version as the server, already arm64, nothing to install on a Spark or on this machine), it takes
the API key from OPENAI_API_KEY rather than from its argv, and its result file carries exactly
the figures users compare (total and output tok/s, TTFT, TPOT, ITL and E2E latency as mean,
median and chosen percentiles) under names other tools read too.

The client runs inside the deployment's serving container (host networking: it talks to
127.0.0.1:PORT, never across the fabric), started by HOST_PROGRAM on the host, which reads the
key from its 0600 file there and hands it to the client on stdin: the key never crosses the SSH
link, and is in no argv and in no container's configuration.

Results are kept on the control machine, one JSON file per run under
RESULTS/DEPLOYMENT/RECIPE_HASH/, named by time, host and image: two runs of the same recipe
compare (`--compare`), and a run on another image says so.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from sparkprov.transport.shell import quote

RESULT_DIR = "/tmp/sparkprov-bench"  # inside the container (its own /tmp; removed with it)

# The host side: stdlib Python, one JSON line on stdout.
HOST_PROGRAM = r'''
import json, os, subprocess, sys, urllib.request
spec = json.loads(sys.argv[1])
name, port, served = spec["container"], spec["port"], spec["model"]
key = ""
if spec.get("keyfile"):
    try:
        with open(os.path.expanduser(spec["keyfile"])) as fh:
            key = fh.read().strip()
    except OSError as e:
        print(json.dumps({"error": "cannot read the API key file %s: %s" % (spec["keyfile"], e.strerror)}))
        sys.exit(0)
def inspect(fmt, *what):
    r = subprocess.run(["docker", "inspect", "--format", fmt, *what], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""
out = {"container": name, "image_id": inspect("{{.Image}}", name), "rows": []}
out["repo_digests"] = json.loads(inspect("{{json .RepoDigests}}", out["image_id"]) or "[]") if out["image_id"] else []
# the tokenizer is the model the server loaded (/v1/models "root"): the served name is only a name
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
req = urllib.request.Request("http://127.0.0.1:%d/v1/models" % port)
if key:
    req.add_header("Authorization", "Bearer " + key)
try:
    with opener.open(req, timeout=10) as r:
        models = json.loads(r.read())["data"]
    root = next((m.get("root") for m in models if m.get("id") == served), None) or served
except Exception as e:
    print(json.dumps({**out, "error": "the server did not list its models: %s" % e}))
    sys.exit(0)
out["tokenizer"] = root
# the key arrives on stdin and goes to the client's environment, which vLLM's client reads
run = ('OPENAI_API_KEY=$(cat); export OPENAI_API_KEY; mkdir -p %s && exec "$@" > %s/bench.log 2>&1'
       % (spec["result_dir"], spec["result_dir"]))
for c in spec["concurrency"]:
    fname = "c%d.json" % c
    argv = ["vllm", "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", "http://127.0.0.1:%d" % port, "--model", served, "--tokenizer", root,
            "--dataset-name", "random", "--random-input-len", str(spec["input_len"]),
            "--random-output-len", str(spec["output_len"]), "--ignore-eos",
            "--num-prompts", str(spec["prompts"] or max(4 * c, 8)), "--max-concurrency", str(c),
            "--request-rate", "inf", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", spec["result_dir"], "--result-filename", fname, "--disable-tqdm"]
    try:
        r = subprocess.run(["docker", "exec", "-i", name, "sh", "-c", run, "sh", *argv], input=key + "\n",
                           capture_output=True, text=True, timeout=spec["timeout"])
        rc = r.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0:
        log = subprocess.run(["docker", "exec", name, "tail", "-n", "6", spec["result_dir"] + "/bench.log"],
                             capture_output=True, text=True)
        out["rows"].append({"concurrency": c, "error": "vllm bench serve %s: %s" % (
            "timed out after %ss" % spec["timeout"] if rc == "timeout" else "exit status %s" % rc,
            " / ".join(l for l in (log.stdout + r.stderr if rc != "timeout" else log.stdout).splitlines() if l.strip())[-600:])})
        break
    got = subprocess.run(["docker", "exec", name, "cat", spec["result_dir"] + "/" + fname], capture_output=True, text=True)
    try:
        out["rows"].append({"concurrency": c, "result": json.loads(got.stdout)})
    except ValueError:
        out["rows"].append({"concurrency": c, "error": "no result file from vllm bench serve: %s" % got.stderr.strip()[:300]})
        break
print(json.dumps(out))
'''


def host_script(spec: dict[str, Any]) -> str:
    return f"python3 - {quote(json.dumps(spec))} <<'SPARKPROV_BENCH'\n{HOST_PROGRAM}\nSPARKPROV_BENCH\n"


def parse_host_output(out: str) -> dict[str, Any]:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no benchmark output: {out.strip()[-300:]!r}")


# What a row keeps of vLLM's result file (its names; median is p50 when asked for 50).
LATENCIES = ("ttft", "tpot", "itl", "e2el")


def summarize(concurrency: int, res: dict[str, Any]) -> dict[str, Any]:
    """One row per concurrency from `vllm bench serve --save-result` (vllm/benchmarks/serve.py names)."""
    row: dict[str, Any] = {"concurrency": concurrency}
    for k in ("num_prompts", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
              "request_throughput", "output_throughput", "total_token_throughput"):
        row[k] = res.get(k)
    for m in LATENCIES:
        row[f"{m}_mean_ms"] = res.get(f"mean_{m}_ms")
        row[f"{m}_p50_ms"] = res.get(f"p50_{m}_ms", res.get(f"median_{m}_ms"))
        row[f"{m}_p99_ms"] = res.get(f"p99_{m}_ms")
    if row["failed"] is None and row["num_prompts"] is not None and row["completed"] is not None:
        row["failed"] = row["num_prompts"] - row["completed"]
    return row


def record(host: str, deployment: str, labels: dict[str, str], params: dict[str, Any], doc: dict[str, Any]) -> dict:
    """What one run keeps: the deployment, its recipe hash and image, the parameters and a row per level."""
    return {"deployment": deployment, "host": host, "recipe": labels.get("sparkprov.recipe"),
            "recipe_hash": labels.get("sparkprov.recipe_hash"), "model": labels.get("sparkprov.model"),
            "tp": labels.get("sparkprov.tp"), "image_id": doc.get("image_id"),
            "repo_digests": doc.get("repo_digests") or [], "tokenizer": doc.get("tokenizer"),
            "client": "vllm bench serve", "params": params,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": [summarize(r["concurrency"], r["result"]) for r in doc.get("rows", []) if "result" in r]}


def _short(image_id: str | None) -> str:
    return (image_id or "unknown").split(":")[-1][:12]


def run_dir(results: Path, rec: dict) -> Path:
    return results / rec["deployment"] / (rec["recipe_hash"] or "no-recipe-hash")


def previous(results: Path, rec: dict) -> dict | None:
    """The last stored run of the same recipe on the same host with the same parameters."""
    d = run_dir(results, rec)
    for p in sorted(d.glob("*.json"), reverse=True):
        try:
            old = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if old.get("host") == rec["host"] and old.get("params") == rec["params"]:
            old["path"] = str(p)
            return old
    return None


def store(results: Path, rec: dict) -> Path:
    d = run_dir(results, rec)
    d.mkdir(parents=True, exist_ok=True)
    stamp = rec["time"].replace("-", "").replace(":", "")
    path = d / f"{stamp}-{rec['host']}-{_short(rec['image_id'])}.json"
    n = 1
    while path.exists():  # two runs in one second
        n += 1
        path = d / f"{stamp}-{rec['host']}-{_short(rec['image_id'])}-{n}.json"
    path.write_text(json.dumps(rec, indent=2) + "\n")
    return path


COMPARED = ("output_throughput", "total_token_throughput", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms", "e2el_p50_ms")


def compare(rec: dict, old: dict) -> dict[str, Any]:
    """Per concurrency both runs have, the change of each compared figure in percent."""
    before = {r["concurrency"]: r for r in old.get("rows", [])}
    out: dict[str, Any] = {"against": old.get("path"), "time": old.get("time"),
                           "same_image": old.get("image_id") == rec.get("image_id"), "levels": {}}
    for r in rec["rows"]:
        b = before.get(r["concurrency"])
        if not b:
            continue
        out["levels"][str(r["concurrency"])] = {k: _pct(b.get(k), r.get(k)) for k in COMPARED}
    return out


def _pct(a, b) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not a or not math.isfinite(a):
        return None
    return round(100.0 * (b - a) / a, 1)


def plot(rec: dict, path: Path) -> Path:
    """Throughput and latency against concurrency (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    rows = rec["rows"]
    xs = [r["concurrency"] for r in rows]
    fig, (thr, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s")):
        thr.plot(xs, [r.get(key) for r in rows], marker="o", label=label)
    thr.set_xlabel("concurrency")
    thr.set_ylabel("tokens/s")
    thr.set_title("throughput")
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50"),
                       ("itl_p99_ms", "ITL p99")):
        lat.plot(xs, [r.get(key) for r in rows], marker="o", label=label)
    lat.set_xlabel("concurrency")
    lat.set_ylabel("ms")
    lat.set_title("latency")
    for ax in (thr, lat):
        if len(xs) > 1 and min(xs) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{rec['deployment']} ({rec.get('recipe')}, TP {rec.get('tp')}) on {rec['host']}: "
                 f"input {rec['params']['input_len']}, output {rec['params']['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
