"""The bench gate of an upgrade (cluster-up --gate bench, issue 26): which stored run a new start is
measured against, with which parameters, and the judgement, on real stored runs of the lab's real
vLLM (tests/fixtures/bench-lab/README.md names each one's source)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from sparkprov.serving import bench as sb

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "bench-lab"
LOW = json.loads((FIX / "guard-run-low.json").read_text())     # 971 output tok/s summed over 1, 4, 16
HIGH = json.loads((FIX / "guard-run-high.json").read_text())   # 1316, the same build and recipe
SMALL = json.loads((FIX / "stored-run.json").read_text())      # another deployment's run: concurrency 1, 2


def rank0_of(run: dict) -> dict:
    """The history's node entry of the start a stored run measured (its image ID and recipe hash)."""
    return {"host": run["host"], "image_id": run["image_id"], "recipe_hash": run["recipe_hash"]}


def test_the_baseline_is_the_newest_run_of_the_last_good_build_and_recipe():
    other_image = {**copy.deepcopy(HIGH), "image_id": "sha256:" + "e" * 64, "time": "2026-11-27T00:00:00Z"}
    other_recipe = {**copy.deepcopy(HIGH), "recipe_hash": "0123456789abcdef", "time": "2026-11-27T00:00:01Z"}
    runs = [LOW, HIGH, other_image, other_recipe]  # oldest first, as stored_runs gives them
    assert sb.gate_baseline(runs, rank0_of(LOW)) is HIGH
    assert sb.gate_baseline(runs, rank0_of(other_image)) is other_image
    assert sb.gate_baseline([LOW], rank0_of(SMALL)) is None  # another build: nothing measured it
    assert sb.gate_baseline([{**LOW, "rows": []}], rank0_of(LOW)) is None  # a run that measured nothing


def test_the_gate_reruns_the_baselines_parameters():
    args = sb.gate_args("tp", HIGH)
    assert args == {"deployment": "tp", "concurrency": [1, 4, 16], "input_len": 256, "output_len": 64,
                    "prompts": 48, "timeout": 3600.0, "profile": None}
    from sparkprov.modules.serve_bench import Args
    Args.model_validate(args)  # serve_bench takes them as they are


def test_the_same_build_against_itself_keeps_what_this_machine_measures_and_no_more():
    """Two runs of one build, lowest against highest: 0.738 kept. A gate of 0.9 fails it (so the lab
    test gates with a ratio its noise passes); 0.7 passes it; the other way round passes any ratio
    up to 1.3."""
    low_vs_high = sb.gate(LOW, HIGH, 0.9)
    assert low_vs_high["levels"] == [1, 4, 16] and low_vs_high["kept"] == pytest.approx(971.3 / 1315.9, abs=0.002)
    assert not low_vs_high["passed"] and low_vs_high["line"].endswith("below the gate"), low_vs_high
    assert sb.gate(LOW, HIGH, 0.7)["passed"]
    assert sb.gate(HIGH, LOW, 1.3)["passed"] and not sb.gate(HIGH, LOW, 1.4)["passed"]
    assert "971.3 output tok/s (concurrency 1,4,16) against 1315.9" in low_vs_high["line"], low_vs_high["line"]


def test_a_build_that_runs_one_request_at_a_time_fails_the_gate():
    """Under load it keeps its single-request speed at every level (what --max-num-seqs 1 does), so
    the sum falls to about three times the concurrency-1 figure."""
    one_at_a_time = copy.deepcopy(HIGH)
    single = HIGH["rows"][0]["output_throughput"]
    for r in one_at_a_time["rows"]:
        r["output_throughput"] = single
    judged = sb.gate(one_at_a_time, HIGH, 0.5)
    assert not judged["passed"] and judged["kept"] < 0.2, judged


def test_failed_requests_count_nothing_and_no_common_level_fails():
    failing = copy.deepcopy(HIGH)
    failing["rows"][2]["failed"] = 3
    judged = sb.gate(failing, HIGH, 0.9)
    assert not judged["passed"] and judged["output_tok_s"] == pytest.approx(
        HIGH["rows"][0]["output_throughput"] + HIGH["rows"][1]["output_throughput"], abs=0.1)
    none = sb.gate(SMALL, HIGH, 0.9)  # concurrency 1, 2 against 1, 4, 16: only 1 in common
    assert none["levels"] == [1]
    nothing = sb.gate({"rows": [{"concurrency": 2, "output_throughput": 10.0, "failed": 0}]}, HIGH, 0.9)
    assert not nothing["passed"] and nothing["kept"] is None and "no level measured by both" in nothing["line"]
