"""A serve playbook's deployments are checked before the first connection (issue 24): an override
value that is not one value (a line break, `$(`, a backtick, a second word that reads as a flag),
an override flag the image's recorded flag set lacks, and a TP size the recipe does not run are
one line at the deployment's place, exit 1, nothing printed. Driven through the real cluster-up
task with an inventory whose hosts listen on nothing (a check made after connecting would end in
"unreachable", exit 4)."""

import contextlib
import io
import json
from pathlib import Path

import pytest
from invoke import Context, Exit

from sparkprov.cli.cluster import cluster_up
from sparkprov.serving.deployment import override_value_problem
from helpers import SAFE_INVENTORY


def playbook(tmp_path: Path, overrides: dict | None = None, *, model: str = "llama-3.3-70b", tp: int = 2) -> Path:
    entry = {"name": "x", "model": model, "hosts": ["s1", "s2"] if tp > 1 else ["s1"], "tp": tp}
    if overrides is not None:
        entry["overrides"] = overrides
    path = tmp_path / "serve.yaml"
    # JSON is YAML: every value keeps its type and escapes, one deployment per file
    path.write_text("deployments:\n  - " + json.dumps(entry) + "\n")
    return path


def up(tmp_path: Path, book: Path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(SAFE_INVENTORY)
    out = io.StringIO()
    with pytest.raises(Exit) as err, contextlib.redirect_stdout(out):
        cluster_up(Context(), playbook=str(book), inventory=str(inv), check=True)
    return err.value, out.getvalue()


def refused(tmp_path: Path, book: Path) -> str:
    err, printed = up(tmp_path, book)
    msg = err.message or ""
    assert err.code == 1, (err.code, msg, printed)
    assert msg.startswith(f"sparkprov: {book}:2:") and msg.isprintable() and len(msg.splitlines()) == 1, msg
    assert "(fix: " in msg
    assert printed == ""  # no PLAY, no host asked
    return msg.removeprefix(f"sparkprov: {book}:")


@pytest.mark.parametrize("value,problem", [
    ("32768\n--trust-remote-code", "holds a line break"),
    ("32768\r", "holds a line break"),
    ("$(id)", "command substitution"),
    ("`id`", "command substitution"),
    ("32768 --trust-remote-code", "reads as an option"),
    ("--enforce-eager", "reads as an option"),
    ("auto -O3", "reads as an option"),
    ({"method": "mtp", "model": "$(touch pwned)"}, "command substitution"),
    ({"a\nb": 1}, "holds a line break"),
    (["x", "y\n"], "holds a line break"),
])
def test_override_value_that_is_not_one_value_is_refused_at_its_position(tmp_path, value, problem):
    msg = refused(tmp_path, playbook(tmp_path, {"--max-model-len": value}))
    assert "deployment 'x': override --max-model-len: " in msg and problem in msg, msg


@pytest.mark.parametrize("value", [32768, "32768", "-1", True, None, 0.9,
                                   {"method": "mtp", "num_speculative_tokens": -1}, ["a b", "-1"],
                                   "a - b", "x=--y"])
def test_override_values_that_are_values_pass(value):
    assert override_value_problem(value) is None


def test_override_flag_outside_the_recorded_set_is_refused_before_any_host(tmp_path):
    msg = refused(tmp_path, playbook(tmp_path, {"--max-modle-len": 4096}))
    assert msg.endswith("deployment 'x': override --max-modle-len is not an option of the vLLM in "
                        "nvcr.io/nvidia/vllm:26.04-py3 (recorded set: vllm-0.19) (fix: check the spelling "
                        "(invoke images --host H --flags lists the image's own), or remove it)"), msg


def test_a_replaced_flag_names_its_replacement(tmp_path):
    msg = refused(tmp_path, playbook(tmp_path, {"--speculative-model": "x/y"}))
    assert "override --speculative-model is not an option" in msg and "--speculative-config" in msg, msg


def test_known_flags_and_removals_reach_the_hosts(tmp_path):
    """A flag the set has, and removing one it lacks, pass the checks: the run goes on to the
    hosts, which listen on nothing (exit 4)."""
    err, printed = up(tmp_path, playbook(tmp_path, {"--max-model-len": 4096, "--no-such-flag": None}))
    assert err.code == 4, (err.message, printed)


def test_playbook_tp_size_the_recipe_does_not_run_is_refused_up_front(tmp_path):
    """gemma-4-31b runs at TP 1 only (tp_sizes: [1]); only --model checked it before."""
    msg = refused(tmp_path, playbook(tmp_path, model="gemma-4-31b", tp=2))
    assert "deployment 'x'" in msg and "gemma-4-31b runs at tp 1" in msg, msg
