"""Stored files sparkprov reads back (issue 33): every one goes through the bounded reader
(sparkprov/inputfiles.py: a regular file of bounded size, never a FIFO) and a model of its shape;
one that does not fit is named and skipped or refused, never a traceback or a hang.

The runs are the lab's real stored runs (tests/fixtures/bench-lab/README.md names each one's
source), spoiled one way each. `invoke bench --export` refusals are hostile command lines of their
own (tests/fixtures/hostile/cli/stored_bench_*.yaml); the commands that skip are driven here, through
the real CLI, because they go on (exit 0, their output on stdout)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from sparkprov.errors import InputError
from sparkprov.serving import bench as sb
from test_inputs_properties import invoke

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "bench-lab"
GOOD = json.loads((FIX / "stored-run.json").read_text())
HIGH = json.loads((FIX / "guard-run-high.json").read_text())


def spoiled(**changes) -> dict:
    return {**copy.deepcopy(GOOD), **changes}


BAD_RUNS = {
    "rows-a-string.json": json.dumps(spoiled(rows="fast")),
    "throughput-a-word.json": json.dumps(spoiled(rows=[{**GOOD["rows"][0], "output_throughput": "fast"}])),
    "tokens-strings.json": json.dumps(spoiled(rows=[{**GOOD["rows"][0], "total_input_tokens": "12461"}])),
    "a-list.json": "[1, 2]",
    "layout-a-string.json": json.dumps(spoiled(provenance={**GOOD["provenance"], "layout": "tp2"})),
    "nested.json": "[" * 100_000 + "]" * 100_000,
    "not-json.json": "{not json",
}


def test_every_real_stored_run_fits_the_model():
    for path in sorted(FIX.glob("*run*.json")):
        assert sb.read_run(path)["rows"], path


@pytest.mark.parametrize("name", sorted(BAD_RUNS))
def test_a_stored_file_that_is_not_a_run_is_one_line_naming_it(tmp_path, name):
    path = tmp_path / name
    path.write_text(BAD_RUNS[name])
    with pytest.raises(InputError) as err:
        sb.read_run(path)
    line = err.value.line()
    assert line.startswith(f"{path}: stored bench run: ") and len(line.splitlines()) == 1 and len(line) < 400, line


def results_with_bad_runs(tmp_path: Path, deployment: str, run: dict) -> tuple[Path, Path]:
    """RESULTS/DEPLOYMENT/HASH: the good run (newest name first: the bad ones are newer), every bad
    one, and a FIFO named like a run (it hung the reader: open() blocks until a writer comes)."""
    d = tmp_path / "bench" / deployment / str(run.get("recipe_hash") or "h")
    d.mkdir(parents=True)
    good = d / "20260101T000000Z-spark1-good.json"
    good.write_text(json.dumps(run))
    for i, (name, text) in enumerate(sorted(BAD_RUNS.items())):
        (d / f"2026010{i + 2}T000000Z-{name}").write_text(text)
    os.mkfifo(d / "20260109T000000Z-spark1-pipe.json")
    return tmp_path / "bench", good


def test_plan_names_and_skips_stored_runs_that_are_not_runs(tmp_path):
    """`invoke plan` printed half its table, then a traceback, on a run whose rows were a string or
    whose throughput was not a number."""
    run = spoiled(recipe="qwen3.6-35b-a3b-ngc", tp="1",
                  provenance={**GOOD["provenance"], "layout": {**GOOD["provenance"]["layout"], "tp": 1, "nodes": 1,
                                                               "hosts": ["spark1"]}},
                  rows=[{**GOOD["rows"][0], "concurrency": 4, "output_throughput": 123.4}])
    results, _ = results_with_bad_runs(tmp_path, "q", run)
    code, out, err = invoke("plan", "qwen3.6-35b-a3b-ngc", "--sparks", "1", "--results", str(results))
    assert "Traceback" not in out + err and code == 0, (code, err)
    assert "measured: concurrency 4: 123.4 output tok/s" in out  # the good run is still used
    lines = err.splitlines()
    assert len(lines) == len(BAD_RUNS) + 1 and all(x.startswith("sparkprov: skipped ") for x in lines), err
    assert any("pipe.json: stored bench run: is a FIFO" in x for x in lines)
    assert any("rows should be a valid list" in x for x in lines)
    assert any("rows[0].output_throughput should be a valid number" in x for x in lines)


def test_the_bench_gate_and_compare_skip_what_is_not_a_run(tmp_path):
    results, good = results_with_bad_runs(tmp_path, HIGH["deployment"], HIGH)
    runs, skipped = sb.stored_runs(results, HIGH["deployment"])
    assert [r["path"] for r in runs] == [str(good)] and len(skipped) == len(BAD_RUNS) + 1
    assert sb.gate_baseline(runs, {"image_id": HIGH["image_id"], "recipe_hash": HIGH["recipe_hash"]})["path"] == str(good)
    old, skipped = sb.previous(results, HIGH)
    assert old["path"] == str(good) and len(skipped) == len(BAD_RUNS) + 1


def test_a_run_is_stored_whole_or_not_at_all(tmp_path, monkeypatch):
    """store() wrote the run with write_text: a run cut short left half a JSON file that every later
    reader then had to skip. Now a failure leaves nothing."""
    import sparkprov.outputs as outputs

    def full_disk(fd, *args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.os, "fsync", full_disk)
    with pytest.raises(OSError):
        sb.store(tmp_path, {**copy.deepcopy(GOOD), "deployment": "tp"})
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
