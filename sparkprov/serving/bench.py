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
compare (`--compare`), and a run on another image says so. Each run carries its provenance: the
registry digest of the running image, the model commit the container's store resolves, the vLLM
version (the server's /version), the driver and CUDA version (the gather's nvidia-smi section),
the kernel and OS (the host identity every gather reads), the recipe hash and the layout; all read
in the two calls a run costs anyway (the gather, and the apply that runs the client). A stored run
exports in the shape of NVIDIA's performance.yaml (`performance_doc`).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, TypedDict

from pydantic import ValidationError

from sparkprov.errors import InputError
from sparkprov.inputfiles import Stored, shape_problem
from sparkprov.transport.shell import quote
from sparkprov.imageref import ImageRef

RESULT_DIR = "/tmp/sparkprov-bench"  # inside the container (its own /tmp; removed with it)
RESULTS_DIR = "~/.local/share/sparkprov/bench"  # on this machine: DEPLOYMENT/RECIPE_HASH/*.json (invoke bench, the gate)


# -- stored runs, read back: the bounded reader and a model of their shape -------------------------------

MAX_RUN_BYTES = 4 * 2**20  # a run of 64 levels is about 40 KiB
MAX_RUN_FILES = 5000       # a results folder larger than this is read in part (newest names first)


class StoredRow(Stored):
    concurrency: int
    num_prompts: int | None = None
    completed: int | None = None
    failed: int | None = None
    total_input_tokens: int | None = None
    total_output_tokens: int | None = None
    duration: float | None = None
    request_throughput: float | None = None
    output_throughput: float | None = None
    total_token_throughput: float | None = None
    ttft_mean_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_mean_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_mean_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    e2el_mean_ms: float | None = None
    e2el_p50_ms: float | None = None
    e2el_p99_ms: float | None = None


class StoredLayout(Stored):
    tp: int = 1
    pp: int = 1
    dp: int = 1
    nodes: int | None = None
    executor: str | None = None
    hosts: list[str] = []


class StoredProvenance(Stored):
    image: str | None = None
    image_id: str | None = None
    image_digest: str | None = None
    model_repo: str | None = None
    model_revision: str | None = None
    model_commit: str | None = None
    vllm_version: str | None = None
    max_model_len: int | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    gpu: str | None = None
    gpu_count: int | None = None
    kernel: str | None = None
    os: str | None = None
    system: str | None = None
    recipe_hash: str | None = None
    layout: StoredLayout | None = None


class StoredParams(Stored):
    concurrency: list[int] | None = None
    input_len: int | None = None
    output_len: int | None = None
    prompts: int | None = None


class StoredRun(Stored):
    rows: list[StoredRow]
    deployment: str | None = None
    host: str | None = None
    time: str | None = None
    recipe: str | None = None
    recipe_hash: str | None = None
    model: str | None = None
    tp: str | int | None = None
    image_id: str | None = None
    repo_digests: list[str] = []
    tokenizer: str | None = None
    client: str | None = None
    params: StoredParams = StoredParams()
    profile: str | None = None
    provenance: StoredProvenance | None = None


NOT_A_RUN_FIX = "move it out of the results folder: it is not a run `invoke bench` stored"


def read_run(path: Path) -> dict[str, Any]:
    """One stored run: a regular file of bounded size (never a FIFO, a device or a folder), JSON,
    shaped as `record` writes it. InputError naming the file and the first thing that does not fit."""
    from sparkprov.inputfiles import read_text_checked

    try:
        text = read_text_checked(path, "stored bench run", MAX_RUN_BYTES)
    except InputError as exc:  # not a regular file, too large, not UTF-8: the fix is the same
        message = exc.message if exc.message.startswith("stored bench run") else f"stored bench run: {exc.message}"
        raise InputError(message, file=str(path), line=exc.lineno, column=exc.column, fix=NOT_A_RUN_FIX) from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise InputError("stored bench run: JSON nested too deeply", file=str(path), fix=NOT_A_RUN_FIX) from None
    except ValueError as exc:
        raise InputError(f"stored bench run: not JSON ({exc})", file=str(path), fix=NOT_A_RUN_FIX) from None
    try:
        StoredRun.model_validate(doc)
    except ValidationError as exc:
        raise InputError(f"stored bench run: {shape_problem(exc)}", file=str(path), fix=NOT_A_RUN_FIX) from None
    return doc


def load_runs(paths: Iterable[Path]) -> tuple[list[dict[str, Any]], list[InputError]]:
    """The stored runs among `paths` (each with its "path"), at most MAX_RUN_FILES, and an
    InputError for each file that is not one (skipped)."""
    runs, skipped = [], []
    for n, path in enumerate(paths):
        if n >= MAX_RUN_FILES:
            break
        try:
            runs.append({**read_run(path), "path": str(path)})
        except InputError as exc:
            skipped.append(exc)
    return runs, skipped

# Run inside the serving container (python3 is in every vLLM image): the refs (branch or tag ->
# commit) of one repo of the store the container reads, as JSON. Which commit the server loaded.
REFS_PROGRAM = """import json, os, sys
hub = os.environ.get("HF_HUB_CACHE") or os.path.join(os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
d, out = os.path.join(hub, sys.argv[1], "refs"), {}
for r, _, fs in os.walk(d):
    for f in fs:
        with open(os.path.join(r, f)) as fh:
            out[os.path.relpath(os.path.join(r, f), d)] = fh.read(100).strip()
print(json.dumps(out))
"""

# The host side: stdlib Python, one JSON line on stdout.
HOST_PROGRAM = r'''
import json, os, re, subprocess, sys, urllib.request
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
REFS_PY = @REFS_PROGRAM@
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
out = {"container": name, "image_id": inspect("{{.Image}}", name), "image": inspect("{{.Config.Image}}", name),
       "rows": []}
out["repo_digests"] = json.loads(inspect("{{json .RepoDigests}}", out["image_id"]) or "[]") if out["image_id"] else []
out["args"] = json.loads(inspect("{{json .Args}}", name) or "[]")
# the tokenizer is the model the server loaded (/v1/models "root"): the served name is only a name
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
req = urllib.request.Request("http://127.0.0.1:%d/v1/models" % port)
if key:
    req.add_header("Authorization", "Bearer " + key)
try:
    with opener.open(req, timeout=10) as r:
        models = json.loads(r.read())["data"]
    mine = next((m for m in models if m.get("id") == served), {})
    root = mine.get("root") or served
except Exception as e:
    print(json.dumps({**out, "error": "the server did not list its models: %s" % e}))
    sys.exit(0)
out["tokenizer"], out["max_model_len"] = root, mine.get("max_model_len")
try:
    with opener.open(urllib.request.Request("http://127.0.0.1:%d/version" % port), timeout=10) as r:
        out["server_version"] = json.loads(r.read()).get("version")
except Exception:
    out["server_version"] = None
# the refs (branch/tag -> commit) of the served repo in the container's own store: which commit it loaded
if root and REPO_RE.match(root):
    try:
        r = subprocess.run(["docker", "exec", name, "python3", "-c", REFS_PY, "models--" + root.replace("/", "--")],
                           capture_output=True, text=True, timeout=30)
        out["refs"] = json.loads(r.stdout) if r.returncode == 0 else None
    except (ValueError, subprocess.TimeoutExpired):  # no commit to name: the run records none
        out["refs"] = None
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
    program = HOST_PROGRAM.replace("@REFS_PROGRAM@", repr(REFS_PROGRAM))
    return f"python3 - {quote(json.dumps(spec))} <<'SPARKPROV_BENCH'\n{program}\nSPARKPROV_BENCH\n"


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


class BenchRun(TypedDict, total=False):
    """One run as bench stores it (record; a run stored by an older sparkprov may lack keys)."""
    deployment: str
    host: str
    recipe: str | None
    recipe_hash: str | None
    model: str | None
    tp: str | None
    image_id: str | None
    repo_digests: list[str]
    tokenizer: str | None
    client: str
    params: dict[str, Any]
    profile: str | None
    provenance: dict[str, Any]     # provenance(): what a later run must match to be compared with it
    time: str
    rows: list[dict[str, Any]]     # summarize(): one per concurrency level
    path: str                      # where it is stored, once read back from there


class Comparison(TypedDict):
    """A run against the last stored one of the same recipe, host and parameters (compare)."""
    against: str | None
    time: str | None
    same_image: bool
    changed: dict[str, list]       # provenance field -> [before, now]
    levels: dict[str, dict[str, float | None]]  # concurrency -> figure -> change in percent


class GateVerdict(TypedDict, total=False):
    """cluster-up --gate bench: a new start's run against its baseline (gate), with the run's stored
    path and the start it was measured against (plays/upgrade.py)."""
    passed: bool
    line: str
    ratio: float
    kept: float | None
    levels: list[int]
    output_tok_s: float
    baseline_tok_s: float
    baseline: str | None
    run: str
    against_start: int


def record(host: str, deployment: str, labels: dict[str, str], params: dict[str, Any], doc: dict[str, Any],
           system: dict[str, Any] | None = None, profile: str | None = None) -> BenchRun:
    """What one run keeps: the deployment, its recipe hash and image, the parameters, a row per
    level, and its provenance (what a later run must match to be compared with it)."""
    return {"deployment": deployment, "host": host, "recipe": labels.get("sparkprov.recipe"),
            "recipe_hash": labels.get("sparkprov.recipe_hash"), "model": labels.get("sparkprov.model"),
            "tp": labels.get("sparkprov.tp"), "image_id": doc.get("image_id"),
            "repo_digests": doc.get("repo_digests") or [], "tokenizer": doc.get("tokenizer"),
            "client": "vllm bench serve", "params": params, "profile": profile,
            "provenance": provenance(labels, doc, system or {}),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": [summarize(r["concurrency"], r["result"]) for r in doc.get("rows", []) if "result" in r]}


# -- provenance: what exactly was measured --------------------------------------------------------

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")


def pick_digest(image: str | None, repo_digests: list[str]) -> str | None:
    """The registry digest (REPO@sha256:...) of the image a container runs: the reference's own
    when it was started by digest, else the one of its repository among the image's RepoDigests,
    else the only one; None for an image that never came from a registry (built or loaded here)."""
    if image and ImageRef.parse(image).digest:
        return image
    repo = ImageRef.parse(image).repository if image else None
    mine = [d for d in repo_digests if ImageRef.parse(d).repository == repo]
    if mine:
        return mine[0]
    return repo_digests[0] if len(repo_digests) == 1 else None


def revision_of(args: list[str]) -> str:
    """The model revision a vLLM command line asks for (`--revision R` / `--revision=R`; main)."""
    for i, w in enumerate(args):
        if w == "--revision" and i + 1 < len(args):
            return args[i + 1]
        if w.startswith("--revision="):
            return w.split("=", 1)[1]
    return "main"


def commit_of(model: str | None, revision: str, refs: dict[str, str] | None) -> str | None:
    """The commit served: the revision when it is one, a snapshot path's own, else the store's ref."""
    if _COMMIT.fullmatch(revision):
        return revision
    m = _SNAPSHOT.search(model or "")
    if m:
        return m.group(1)
    commit = (refs or {}).get(revision.removeprefix("refs/"))
    return commit if commit and _COMMIT.fullmatch(commit) else None


def layout_of(labels: dict[str, str], hosts: list[str] | None = None) -> dict[str, Any]:
    """tp x pp (x dp) over how many nodes, and which hosts (rank order), from the container labels."""
    def num(key: str, default: int = 1) -> int:
        try:
            return max(1, int(labels.get(key) or default))
        except ValueError:
            return default

    tp, dp = num("sparkprov.tp"), num("sparkprov.dp")
    nodes = num("sparkprov.nodes")
    return {"tp": tp, "pp": max(1, nodes // (tp * dp)) if dp == 1 else 1, "dp": dp, "nodes": nodes,
            "executor": labels.get("sparkprov.executor") or ("single" if nodes == 1 else None),
            "hosts": list(hosts or [])}


def provenance(labels: dict[str, str], doc: dict[str, Any], system: dict[str, Any]) -> dict[str, Any]:
    """Image digest, model repo and commit, vLLM, driver, kernel, recipe hash and layout of one run.
    `doc`: the host program's reads of the container; `system`: the host's gathered facts."""
    model = doc.get("tokenizer")
    revision = revision_of([str(a) for a in doc.get("args") or []])
    return {"image": doc.get("image"), "image_id": doc.get("image_id"),
            "image_digest": pick_digest(doc.get("image"), doc.get("repo_digests") or []),
            "model_repo": model if model and not model.startswith("/") else labels.get("sparkprov.model"),
            "model_revision": revision, "model_commit": commit_of(model, revision, doc.get("refs")),
            "vllm_version": doc.get("server_version"), "max_model_len": doc.get("max_model_len"),
            "driver_version": system.get("driver_version"), "cuda_version": system.get("cuda_version"),
            "gpu": system.get("gpu"), "gpu_count": system.get("gpu_count"), "kernel": system.get("kernel"),
            "os": system.get("os"), "system": system.get("system"),
            "recipe_hash": labels.get("sparkprov.recipe_hash"), "layout": layout_of(labels, [])}


def system_facts(gpu: dict[str, Any] | None, info: dict[str, str]) -> dict[str, Any]:
    """What a run keeps of the host (the gathered NvidiaSmi fact and the host's identity)."""
    gpu = gpu or {}
    gpus = gpu.get("gpus") or []
    return {"driver_version": gpu.get("driver_version"), "cuda_version": gpu.get("cuda_version"),
            "gpu": gpus[0].get("name") if gpus else None, "gpu_count": len(gpus) or None,
            "kernel": info.get("kernel"), "os": info.get("os_pretty_name"),
            "system": info.get("dgx_pretty_name") or info.get("dgx_name")}


def with_hosts(rec: BenchRun, hosts: list[str]) -> BenchRun:
    """The run with the deployment's hosts (rank 0 first) in its layout."""
    prov = dict(rec.get("provenance") or {})
    prov["layout"] = {**(prov.get("layout") or {}), "hosts": list(hosts)}
    return {**rec, "provenance": prov}


def _short(image_id: str | None) -> str:
    return (image_id or "unknown").split(":")[-1][:12]


def run_dir(results: Path, rec: BenchRun) -> Path:
    return results / rec["deployment"] / (rec["recipe_hash"] or "no-recipe-hash")


def previous(results: Path, rec: BenchRun) -> tuple[BenchRun | None, list[InputError]]:
    """The last stored run of the same recipe on the same host with the same parameters, and the
    stored files that are not runs (skipped, each named)."""
    runs, skipped = load_runs(sorted(run_dir(results, rec).glob("*.json"), reverse=True))
    found = next((old for old in runs if old.get("host") == rec["host"] and old.get("params") == rec["params"]), None)
    return found, skipped


def store(results: Path, rec: BenchRun) -> Path:
    """The run as a new file under results (written whole or not at all)."""
    from sparkprov.outputs import write_text_atomic

    d = run_dir(results, rec)
    d.mkdir(parents=True, exist_ok=True)
    stamp = rec["time"].replace("-", "").replace(":", "")
    path = d / f"{stamp}-{rec['host']}-{_short(rec['image_id'])}.json"
    n = 1
    while path.exists():  # two runs in one second
        n += 1
        path = d / f"{stamp}-{rec['host']}-{_short(rec['image_id'])}-{n}.json"
    write_text_atomic(path, json.dumps(rec, indent=2) + "\n")
    return path


COMPARED = ("output_throughput", "total_token_throughput", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms", "e2el_p50_ms")


def compare(rec: BenchRun, old: BenchRun) -> Comparison:
    """Per concurrency both runs have, the change of each compared figure in percent."""
    before = {r["concurrency"]: r for r in old.get("rows", [])}
    out: Comparison = {"against": old.get("path"), "time": old.get("time"),
                           "same_image": old.get("image_id") == rec.get("image_id"),
                           "changed": provenance_changes(old, rec), "levels": {}}
    for r in rec["rows"]:
        b = before.get(r["concurrency"])
        if not b:
            continue
        out["levels"][str(r["concurrency"])] = {k: _pct(b.get(k), r.get(k)) for k in COMPARED}
    return out


# What must be the same for two runs to measure the same thing (a run stored before provenance
# was recorded has none of these: nothing is said about it).
PROVENANCE_COMPARED = ("image_digest", "model_commit", "vllm_version", "driver_version", "kernel", "recipe_hash")


def provenance_changes(old: BenchRun, new: BenchRun) -> dict[str, list]:
    """{field: [before, now]} for each provenance field both runs recorded and that differs."""
    a, b = old.get("provenance") or {}, new.get("provenance") or {}
    return {k: [a[k], b.get(k)] for k in PROVENANCE_COMPARED if a.get(k) is not None and a.get(k) != b.get(k)}


def _pct(a, b) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not a or not math.isfinite(a):
        return None
    return round(100.0 * (b - a) / a, 1)


def plot(rec: BenchRun, path: Path) -> Path:
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
    tmp = path.with_name(f".{path.name}.tmp")
    try:  # whole or not at all, as every output
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


# -- named profiles ---------------------------------------------------------------------------------

# The community leaderboard's parameters (llama-benchy at pp2048/tg128, concurrency 1, 2, 5, 10;
# issue 26): the same workload run with vLLM's client, so a Spark's figures sit beside the board's.
PROFILES: dict[str, dict[str, Any]] = {
    "arena": {"input_len": 2048, "output_len": 128, "concurrency": [1, 2, 5, 10]},
}


# -- NVIDIA's performance.yaml ----------------------------------------------------------------------

def stored_runs(results: Path, deployment: str) -> tuple[list[dict[str, Any]], list[InputError]]:
    """Every stored run of a deployment (all recipe hashes), oldest first by the time it recorded,
    each with its "path"; and the files among them that are not runs (each named, skipped)."""
    runs, skipped = load_runs(sorted((results / deployment).glob("*/*.json"), reverse=True))
    return sorted(runs, key=lambda r: (r.get("time") or "", r["path"])), skipped


def _per_second(tokens: Any, ms: Any) -> float | None:
    if not isinstance(tokens, (int, float)) or not isinstance(ms, (int, float)) or ms <= 0:
        return None
    return round(tokens * 1000.0 / ms, 2)


def _round(v: Any) -> float | None:
    return round(v, 2) if isinstance(v, (int, float)) else None


def _day(stamp: str | None):
    """The day of a run (a YAML date, as NVIDIA's measured_at is written)."""
    import datetime

    try:
        return datetime.date.fromisoformat((stamp or "")[:10])
    except ValueError:
        return None


def performance_doc(rec: BenchRun) -> dict[str, Any]:
    """A stored run in the shape of the `performance.yaml` files of NVIDIA's recipe catalog
    (NVIDIA/local-ai-inference-recipes: schema 1, one profile per workload), one profile per
    concurrency level. What vLLM's summary does not give is null: the prompt lengths' min and max
    (its random prompts are all --input-len long). Per request: prefill tok/s is prompt tokens over
    TTFT and decode tok/s is one token per TPOT, both from the level's means. Runs stored before
    provenance was recorded export with nulls where it would be."""
    prov = rec.get("provenance") or {}
    layout = prov.get("layout") or layout_of({"sparkprov.tp": str(rec.get("tp") or 1),
                                              "sparkprov.nodes": str(rec.get("tp") or 1)})
    nodes = layout.get("nodes") or 1
    name = prov.get("system") or prov.get("gpu")
    digest = prov.get("image_digest") or pick_digest(None, rec.get("repo_digests") or [])
    os_version = prov.get("os")
    if prov.get("kernel"):  # the schema has no kernel field: it goes with the OS
        os_version = f"{os_version or 'Linux'} (kernel {prov['kernel']})"
    params = rec.get("params") or {}
    profile = rec.get("profile") or "custom"
    profiles = []
    for row in rec.get("rows") or []:
        done = row.get("completed") or 0
        prompt = row.get("total_input_tokens") / done if done and row.get("total_input_tokens") else None
        profiles.append({
            "id": f"{profile}-c{row['concurrency']}",
            "workload": {"input_tokens": params.get("input_len"), "context_tokens": prov.get("max_model_len"),
                         "dataset": "random", "profile": profile, "input_tokens_min": None, "input_tokens_max": None,
                         "input_tokens_total": row.get("total_input_tokens"), "output_tokens": params.get("output_len"),
                         "concurrency": row["concurrency"], "requests": row.get("num_prompts"),
                         # vLLM's client sends one request before it measures
                         "warmup_requests": 1},
            "results": {"prefill_tokens_per_second_mean": _per_second(prompt, row.get("ttft_mean_ms")),
                        "decode_tokens_per_second_mean": _per_second(1, row.get("tpot_mean_ms")),
                        "e2e_latency_ms_mean": _round(row.get("e2el_mean_ms"))},
        })
    return {
        "schema_version": 1,
        "status": "measured",
        "recipe_sha256": rec.get("recipe_hash"),  # sparkprov's recipe hash (sha256 of the launch, 16 hex)
        "launch_id": rec.get("recipe") or "default",
        "measured_at": _day(rec.get("time")),
        "harness": {"name": rec.get("client") or "vllm bench serve", "version": prov.get("vllm_version")},
        "system": {"label": (f"{nodes}× {name}" if nodes > 1 else name) if name else None,
                   "accelerator": prov.get("gpu"), "accelerator_count": (prov.get("gpu_count") or 1) * nodes,
                   "operating_system": "linux", "os_version": os_version,
                   "driver_version": prov.get("driver_version"), "cuda_version": prov.get("cuda_version")},
        "software": {"backend_version": prov.get("vllm_version"), "model_revision": prov.get("model_commit"),
                     "runtime_revision": ImageRef.parse(digest).digest if digest else None},
        "profiles": profiles,
    }


def performance_yaml(rec: BenchRun) -> str:
    import yaml

    return yaml.safe_dump(performance_doc(rec), sort_keys=False, allow_unicode=True, width=120)


# -- the bench gate of an upgrade (cluster-up --gate bench) -----------------------------------------

DEFAULT_GATE_RATIO = 0.9  # issue 26: the new start keeps at least 0.9 of the last good's output tok/s


def gate_baseline(runs: list[BenchRun], rank0: dict[str, Any]) -> BenchRun | None:
    """The newest stored run (oldest first in `runs`) of the build and recipe a start ran on its
    rank 0 (`rank0`: the history's node entry: image ID and recipe hash): what an upgrade of that
    start is measured against. A run of another image or recipe measured something else."""
    for run in reversed(runs):
        if run.get("image_id") and run.get("image_id") == rank0.get("image_id") \
                and run.get("recipe_hash") == rank0.get("recipe_hash") and run.get("rows"):
            return run
    return None


def gate_args(deployment: str, baseline: BenchRun) -> dict[str, Any]:
    """serve_bench's arguments for the gate's run: the baseline's own parameters."""
    p = baseline.get("params") or {}
    return {"deployment": deployment, "concurrency": list(p.get("concurrency") or [r["concurrency"]
                                                                                for r in baseline["rows"]]),
            "input_len": p.get("input_len") or 1024, "output_len": p.get("output_len") or 128,
            "prompts": p.get("prompts"), "timeout": 3600.0, "profile": baseline.get("profile")}


def gate(new: BenchRun, baseline: BenchRun, ratio: float) -> GateVerdict:
    """Whether a new start's run keeps up with the baseline: the output tok/s summed over the
    concurrency levels both measured, new against old, at least `ratio`. Summed, not per level:
    one level's noise (a 2-core lab measures +-10% at concurrency 1) does not decide alone, and a
    build that batches worse loses at every level above 1. A level that failed requests counts 0."""
    def per_level(rec):
        out = {}
        for r in rec.get("rows") or []:
            v = r.get("output_throughput")
            if isinstance(v, (int, float)):
                out[r["concurrency"]] = 0.0 if r.get("failed") else float(v)
        return out

    old, now = per_level(baseline), per_level(new)
    levels = sorted(set(old) & set(now))
    before, after = sum(old[c] for c in levels), sum(now[c] for c in levels)
    kept = after / before if before > 0 else None
    passed = kept is not None and kept >= ratio
    at = ",".join(str(c) for c in levels) or "none"
    line = (f"bench gate: {after:.1f} output tok/s (concurrency {at}) against {before:.1f} of the last good start"
            + (f", {kept:.2f} of it (gate {ratio:.2f})" if kept is not None else ": no level measured by both")
            + ("" if passed else ": below the gate"))
    return {"passed": passed, "ratio": ratio, "kept": None if kept is None else round(kept, 3), "levels": levels,
            "output_tok_s": round(after, 1), "baseline_tok_s": round(before, 1),
            "baseline": baseline.get("path"), "line": line}
