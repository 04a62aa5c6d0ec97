"""invoke bench's named profile (arena), a stored run exported as NVIDIA's performance.yaml, and
runs stored before provenance was recorded (they still load, compare, plot and export).

tests/fixtures/nvidia-recipes/gemma-4-26b-a4b-dgx-spark-vllm-performance.yaml is a real file, unchanged:
NVIDIA/local-ai-inference-recipes models/google/gemma-4-26b-a4b/dgx-spark/linux/vllm/performance.yaml at
12b25c664d8bea9a819f6e6e33d59267dd7528df (aiperf on one DGX Spark).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from invoke import Context

from sparkprov.cli.bench import BenchOptions, bench
from sparkprov.errors import SparkprovError
from sparkprov.options import parse_options
from sparkprov.serving import bench as sb

NVIDIA_PERF = Path(__file__).parents[1] / "fixtures" / "nvidia-recipes" / "gemma-4-26b-a4b-dgx-spark-vllm-performance.yaml"
LABELS = {"sparkprov.recipe": "lab-tiny", "sparkprov.recipe_hash": "0123456789abcdef", "sparkprov.tp": "2",
          "sparkprov.model": "lab-tiny", "sparkprov.port": "8000", "sparkprov.executor": "native",
          "sparkprov.nodes": "2", "sparkprov.rank": "0"}


def vllm_result(c: int, out_tps: float) -> dict:
    """The names `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py)."""
    doc = {"num_prompts": 8, "completed": 8, "failed": 0, "duration": 2.0, "max_concurrency": c,
           "total_input_tokens": 16384, "total_output_tokens": 1024, "request_throughput": 4.0,
           "output_throughput": out_tps, "total_token_throughput": out_tps * 17}
    for i, m in enumerate(("ttft", "tpot", "itl", "e2el")):
        doc.update({f"mean_{m}_ms": 100.0 * (i + 1), f"median_{m}_ms": 90.0, f"p50_{m}_ms": 90.0, f"p99_{m}_ms": 400.0})
    return doc


def host_doc() -> dict:
    return {"container": "sparkprov-tiny-rank0", "image_id": "sha256:" + "ab" * 32, "image": "sparkprov/lab-vllm-cpu:0.32.0",
            "repo_digests": ["sparkprov/lab-vllm-cpu@sha256:" + "cd" * 32], "tokenizer": "sparkprov/lab-tiny",
            "args": ["-c", "script", "sparkprov-rank0", "vllm", "serve", "sparkprov/lab-tiny"],
            "refs": {"main": "1f" * 20}, "server_version": "0.32.0", "max_model_len": 2048,
            "rows": [{"concurrency": c, "result": vllm_result(c, t)} for c, t in ((1, 30.0), (2, 55.0))]}


SYSTEM = {"driver_version": "580.95.05", "cuda_version": "13.0", "gpu": "NVIDIA GB10", "gpu_count": 1,
          "kernel": "6.11.0-1016-nvidia", "os": "Ubuntu 24.04.3 LTS", "system": "DGX Spark"}


def run(profile="arena") -> dict:
    params = {"concurrency": [1, 2], "input_len": 2048, "output_len": 128, "prompts": None}
    return sb.with_hosts(sb.record("spark1", "tiny", LABELS, params, host_doc(), SYSTEM, profile), ["spark1", "spark2"])


def bench_args(deployment: str, **raw) -> dict:
    """The serve_bench arguments from the options as the command line gives them (text)."""
    return parse_options(BenchOptions, {"deployment": deployment, **raw}).serve_bench_args()


def test_arena_profile_gives_the_leaderboards_workload_and_options_override():
    assert bench_args("d", profile="arena") | {"deployment": "d"} == {
        "deployment": "d", "concurrency": [1, 2, 5, 10], "input_len": 2048, "output_len": 128, "prompts": None,
        "timeout": 3600.0, "profile": "arena"}
    mixed = bench_args("d", profile="arena", concurrency="1,64", output_len="256")
    assert (mixed["concurrency"], mixed["input_len"], mixed["output_len"]) == ([1, 64], 2048, 256)
    plain = bench_args("d")
    assert (plain["concurrency"], plain["input_len"], plain["output_len"], plain["profile"]) == ([1, 4, 16, 64], 1024,
                                                                                                  128, None)
    with pytest.raises(SparkprovError, match="--profile 'leaderboard' is not one of arena"):
        bench_args("d", profile="leaderboard")


def test_export_has_the_keys_and_structure_of_nvidias_performance_yaml(tmp_path):
    theirs = yaml.safe_load(NVIDIA_PERF.read_text())
    text = sb.performance_yaml(run())
    ours = yaml.safe_load(text)
    # every key, in NVIDIA's order, at every level; the values a run measured are numbers where theirs are
    assert list(ours) == list(theirs)
    for section in ("harness", "system", "software"):
        assert list(ours[section]) == list(theirs[section]), section
    (p0,) = theirs["profiles"]
    assert [list(p) for p in ours["profiles"]] == [list(p0)] * 2
    assert [list(p["workload"]) for p in ours["profiles"]] == [list(p0["workload"])] * 2
    assert [list(p["results"]) for p in ours["profiles"]] == [list(p0["results"])] * 2
    for key, value in p0["results"].items():
        assert all(isinstance(p["results"][key], type(value)) for p in ours["profiles"]), key
    # what it says: the digest, the model commit, the driver, the kernel, per-level figures
    assert ours["software"] == {"backend_version": "0.32.0", "model_revision": "1f" * 20,
                                "runtime_revision": "sha256:" + "cd" * 32}
    assert ours["system"]["driver_version"] == "580.95.05" and "6.11.0-1016-nvidia" in ours["system"]["os_version"]
    assert ours["system"]["label"] == "2× DGX Spark" and ours["system"]["accelerator_count"] == 2
    c1 = ours["profiles"][0]
    assert c1["id"] == "arena-c1" and c1["workload"]["concurrency"] == 1 and c1["workload"]["context_tokens"] == 2048
    # 16384 prompt tokens over 8 requests in a mean TTFT of 100 ms; one token per 200 ms TPOT
    assert c1["results"] == {"prefill_tokens_per_second_mean": 20480.0, "decode_tokens_per_second_mean": 5.0,
                             "e2e_latency_ms_mean": 400.0}
    assert "!!" not in text  # plain YAML: no Python tags


def test_cli_exports_the_newest_stored_run(tmp_path, capsys):
    older = run(profile=None)
    older["time"] = "2026-01-01T00:00:00Z"
    sb.store(tmp_path, older)
    newest = run()
    sb.store(tmp_path, newest)
    out = tmp_path / "performance.yaml"
    bench(Context(), "tiny", export=str(out), results=str(tmp_path), check=True)
    assert not out.exists() and "nothing written" in capsys.readouterr().out
    bench(Context(), "tiny", export=str(out), results=str(tmp_path))
    assert "(NVIDIA performance.yaml, 2 profile(s))" in capsys.readouterr().out
    doc = yaml.safe_load(out.read_text())
    assert doc["profiles"][0]["id"] == "arena-c1" and str(doc["measured_at"]) == newest["time"][:10]


def test_a_run_stored_before_provenance_loads_compares_plots_and_exports(tmp_path):
    # the shape `invoke bench` stored before issue 26: no provenance, profile or layout
    old = {"deployment": "tiny", "host": "spark1", "recipe": "lab-tiny", "recipe_hash": "0123456789abcdef",
           "model": "lab-tiny", "tp": "2", "image_id": "sha256:" + "ab" * 32,
           "repo_digests": ["sparkprov/lab-vllm-cpu@sha256:" + "cd" * 32], "tokenizer": "sparkprov/lab-tiny",
           "client": "vllm bench serve", "params": {"concurrency": [1, 2], "input_len": 2048, "output_len": 128,
                                                     "prompts": None},
           "time": "2026-01-01T00:00:00Z", "rows": [sb.summarize(1, vllm_result(1, 33.0))]}
    d = tmp_path / "tiny" / "0123456789abcdef"
    d.mkdir(parents=True)
    (d / "20260101T000000Z-spark1-abababababab.json").write_text(json.dumps(old))
    new = run()
    before = sb.previous(tmp_path, new)[0]
    assert before["time"] == old["time"]
    cmp = sb.compare(new, before)
    assert cmp["same_image"] and cmp["changed"] == {} and cmp["levels"]["1"]["output_throughput"] == pytest.approx(-9.1)
    assert sb.plot(before, tmp_path / "old.png").read_bytes()[:4] == b"\x89PNG"
    exported = sb.performance_doc(before)
    assert exported["software"]["runtime_revision"] == "sha256:" + "cd" * 32
    assert exported["software"]["model_revision"] is None and exported["system"]["accelerator_count"] == 2


def test_compare_names_what_changed_between_two_runs():
    a, b = run(), run()
    b["provenance"] = {**b["provenance"], "driver_version": "580.126.09", "image_digest": "x@sha256:" + "ee" * 32}
    changed = sb.compare(b, a)["changed"]
    assert changed == {"image_digest": ["sparkprov/lab-vllm-cpu@sha256:" + "cd" * 32, "x@sha256:" + "ee" * 32],
                       "driver_version": ["580.95.05", "580.126.09"]}


def test_a_real_stored_run_exports_in_nvidias_shape():
    """tests/fixtures/bench-lab/stored-run.json: a run stored by invoke bench on the lab's real vLLM."""
    rec = json.loads((Path(__file__).parents[1] / "fixtures" / "bench-lab" / "stored-run.json").read_text())
    theirs = yaml.safe_load(NVIDIA_PERF.read_text())
    ours = yaml.safe_load(sb.performance_yaml(rec))
    assert list(ours) == list(theirs) and type(ours["measured_at"]) is type(theirs["measured_at"])
    for section in ("harness", "system", "software"):
        assert list(ours[section]) == list(theirs[section]), section
    assert [list(p["workload"]) for p in ours["profiles"]] == [list(theirs["profiles"][0]["workload"])] * 2
    assert ours["software"]["runtime_revision"] == rec["provenance"]["image_digest"].split("@")[1]
    assert ours["software"]["model_revision"] == rec["provenance"]["model_commit"]
    assert all(p["results"]["decode_tokens_per_second_mean"] > 0 for p in ours["profiles"])
