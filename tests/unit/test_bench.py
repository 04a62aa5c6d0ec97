"""invoke bench's results (sparkprov/serving/bench.py): what a run keeps of vLLM's result file,
where it is stored, what --compare compares against, the plot; and the host program's refusal
of an unreadable key file, run for real with python3 (no docker needed to get that far)."""

from __future__ import annotations

import json
import subprocess

from sparkprov.serving import bench as sb

LABELS = {"sparkprov.recipe": "llama-3.3-70b", "sparkprov.recipe_hash": "0123456789abcdef", "sparkprov.tp": "2",
          "sparkprov.model": "llama-3.3-70b", "sparkprov.port": "8000"}
PARAMS = {"concurrency": [1, 4], "input_len": 32, "output_len": 16, "prompts": None}


def vllm_result(c: int, out_tps: float) -> dict:
    """The names `vllm bench serve --save-result` writes with --percentile-metrics ttft,tpot,itl,e2el
    --metric-percentiles 50,99 (vllm/benchmarks/serve.py)."""
    doc = {"num_prompts": 8, "completed": 8, "failed": 0, "duration": 2.0, "max_concurrency": c,
           "total_input_tokens": 256, "total_output_tokens": 128, "request_throughput": 4.0,
           "output_throughput": out_tps, "total_token_throughput": out_tps * 3}
    for i, m in enumerate(("ttft", "tpot", "itl", "e2el")):
        doc.update({f"mean_{m}_ms": 10.0 + i, f"median_{m}_ms": 9.0 + i, f"std_{m}_ms": 1.0,
                    f"p50_{m}_ms": 9.0 + i, f"p99_{m}_ms": 20.0 + i})
    return doc


def host_doc(image="sha256:" + "ab" * 32, tps=(60.0, 200.0)):
    return {"container": "sparkprov-tp-head", "image_id": image, "repo_digests": [], "tokenizer": "/models/x",
            "rows": [{"concurrency": c, "result": vllm_result(c, t)} for c, t in zip((1, 4), tps)]}


def test_summarize_keeps_throughput_and_latencies_by_level():
    row = sb.summarize(4, vllm_result(4, 200.0))
    assert row["concurrency"] == 4 and row["output_throughput"] == 200.0 and row["total_token_throughput"] == 600.0
    assert (row["ttft_mean_ms"], row["ttft_p50_ms"], row["ttft_p99_ms"]) == (10.0, 9.0, 20.0)
    assert (row["itl_p50_ms"], row["e2el_p99_ms"]) == (11.0, 23.0)
    # vLLM's default percentiles (99 only): the median stands for p50
    doc = vllm_result(1, 50.0)
    doc.pop("p50_ttft_ms")
    assert sb.summarize(1, doc)["ttft_p50_ms"] == 9.0


def test_store_compare_and_plot(tmp_path):
    first = sb.record("spark1", "tp", LABELS, PARAMS, host_doc())
    p1 = sb.store(tmp_path, first)
    assert p1.parent == tmp_path / "tp" / "0123456789abcdef" and p1.name.endswith("-spark1-abababababab.json")
    assert sb.previous(tmp_path, first)[0]["rows"] == first["rows"]
    second = sb.record("spark1", "tp", LABELS, PARAMS, host_doc(tps=(66.0, 150.0)))
    old = sb.previous(tmp_path, second)[0]
    cmp = sb.compare(second, old)
    assert cmp["same_image"] and cmp["against"] == str(p1)
    assert cmp["levels"]["1"]["output_throughput"] == 10.0 and cmp["levels"]["4"]["output_throughput"] == -25.0
    p2 = sb.store(tmp_path, second)
    assert p2 != p1 and json.loads(p2.read_text())["rows"][1]["output_throughput"] == 150.0
    # other parameters, or another host: not the same benchmark
    other = sb.record("spark1", "tp", LABELS, {**PARAMS, "input_len": 64}, host_doc())
    assert sb.previous(tmp_path, other)[0] is None
    assert sb.previous(tmp_path, sb.record("spark2", "tp", LABELS, PARAMS, host_doc()))[0] is None
    # another image under the same recipe: compared, and said
    moved = sb.record("spark1", "tp", LABELS, PARAMS, host_doc(image="sha256:" + "cd" * 32))
    assert sb.compare(moved, sb.previous(tmp_path, moved)[0])["same_image"] is False
    png = sb.plot(second, p2.with_suffix(".png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_host_program_names_an_unreadable_key_file(tmp_path):
    spec = {"container": "c", "port": 9, "model": "m", "keyfile": str(tmp_path / "missing"), "concurrency": [1],
            "input_len": 8, "output_len": 8, "prompts": None, "timeout": 10, "result_dir": sb.RESULT_DIR}
    r = subprocess.run(["sh", "-c", sb.host_script(spec)], capture_output=True, text=True, timeout=30)
    doc = sb.parse_host_output(r.stdout)
    assert "cannot read the API key file" in doc["error"] and str(tmp_path / "missing") in doc["error"]
