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


# -- a deployment's history (rank 0's history.jsonl, read by a fact) -----------------------------------

def test_history_records_that_do_not_fit_are_skipped_and_named_by_line():
    from sparkprov.plays.upgrade import deployment_from
    from sparkprov.serving import history

    good = {"n": 1, "time": "2026-01-01T00:00:00Z", "kind": "start", "result": "passed",
            "spec": {"name": "tiny", "model": "lab-tiny", "hosts": ["spark1"], "tp": 1},
            "model": {"repo": "r", "commit": "a" * 40}, "nodes": {"spark1": {"image": "img", "image_id": "sha256:" + "b" * 64}}}
    lines = [json.dumps(good),
             json.dumps({**good, "n": 2, "nodes": ["spark1"]}),          # rows() called .items() on it
             json.dumps({**good, "n": 3, "spec": "tp2"}),                # last_good compared .items() of it
             json.dumps({**good, "n": 4, "spec": {**good["spec"], "pp": "2"}}),  # rows() compared "2" > 1
             json.dumps({**good, "n": "5"}),
             '{"n": 6, "nodes": ' * 2000 + "}" * 2000,
             '{"n": 7, "ti']                                             # a write cut short
    assert history.rows(history.parse("\n".join(lines)))  # rows() raised AttributeError on record 2
    records, skipped = history.read("\n".join(lines))
    assert [r["n"] for r in records] == [1]
    assert skipped[:4] == ["line 2: nodes should be a JSON object", "line 3: spec should be a JSON object",
                           "line 4: spec.pp should be a valid integer", "line 5: n should be a valid integer"]
    assert len(skipped) == 6 and history.rows(records) and history.last_good(records)["n"] == 1
    # a spec that fits the record but is no deployment (edited by hand) is one line, not a traceback
    with pytest.raises(InputError, match="the recorded spec of 'tiny' is no deployment: tp:"):
        deployment_from({**good["spec"], "tp": 99})


def test_the_history_fact_reads_the_newest_bytes_only():
    from sparkprov.facts.base import ShellCtx
    from sparkprov.facts.history import MAX_BYTES, HistoryFile

    script = HistoryFile("~/x/history.jsonl").command(ShellCtx(home="/home/nvidia"))
    assert f"tail -c {MAX_BYTES} " in script and "[ -f " in script


# -- the node guard's records (its state file and journal, read by a fact) -----------------------------

def test_guard_records_that_do_not_fit_are_named_never_a_traceback():
    from sparkprov.facts.guard import describe, guard_summary, parse_guard_state

    head = "now=1010\ninstalled=1\nsystemd=1\nrunning=4242\n"
    event = {"time": "t", "epoch": 1.0, "kind": "mem-low", "reading": "1 GiB", "threshold": "6 GiB", "action": "stop"}
    for state in ('{"sample": {"t": "1000", "mem": {}}}', '{"sample": {"t": 1000, "mem": [1]}}', "[1]",
                  '{"sample": {"t": 1000, "gpu": {"temperature_c": "hot"}}}', '{"held": {"x": "y"}}', "{not json"):
        out = f"{head}@state\n{state}\n@events\n{json.dumps(event)}\n[1]\n{{\"epoch\": \"x\"}}\n"
        fact = parse_guard_state(out)
        s = guard_summary(fact)
        assert fact["state"] is None and s["events"] == [event], state
        line = describe("spark1", s)
        assert "the guard's state file does not fit" in line and "2 line(s) of the guard's journal are no event" in line


def test_the_guard_fact_reads_bounded_regular_files():
    from sparkprov.facts.base import ShellCtx
    from sparkprov.facts.guard import EVENTS_BYTES, STATE_BYTES, GuardState

    script = GuardState("/p", "/pid", "/s.json", "/e.jsonl").command(ShellCtx(home="/root"))
    assert f"[ -f /s.json ] && head -c {STATE_BYTES} /s.json" in script  # `cat` of a FIFO there blocked
    assert f"[ -f /e.jsonl ] && tail -c {EVENTS_BYTES} /e.jsonl" in script


# -- the fabric qualification record ---------------------------------------------------------------

@pytest.mark.parametrize("doc,says", [
    ({"rails": "degraded"}, "rails should be a valid list"),
    ({"rails": [{"status": "degraded", "gbps": "13", "floor_gbps": 46}]}, "rails[0].gbps should be a valid number"),
    ([1], "the document should be a JSON object"),
])
def test_a_qualification_record_that_does_not_fit_is_named_with_the_fix(doc, says):
    from sparkprov.facts.base import FactError
    from sparkprov.facts.rail import QUAL_PATH, degraded, parse_record

    with pytest.raises(FactError) as err:
        degraded("spark1", parse_record(json.dumps(doc)))
    assert str(err.value).startswith(f"{QUAL_PATH} is not a qualification record: {says}") and "sudo rm" in str(err.value)


# -- an image's cached `vllm serve --help=all` ------------------------------------------------------

@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8\n", b"--max-model-len\nnot a flag line\n",
                                     b"--x\n" * (2**20 // 4 + 1)])
def test_a_cached_flag_set_that_does_not_read_is_one_line_naming_it(tmp_path, content):
    from sparkprov.catalog.knownflags import cache_path, known_flags

    digest = "sha256:" + "c" * 64
    path = cache_path(tmp_path, digest)
    path.write_bytes(content)
    with pytest.raises(InputError) as err:
        known_flags("vllm/vllm-openai:v0.19.0", None, tmp_path, digest=digest)
    line = err.value.line()
    assert line.startswith(f"{path}") and "the cached `vllm serve --help=all`" in line and "remove the file" in line
    assert len(line.splitlines()) == 1 and len(line) < 400, line
