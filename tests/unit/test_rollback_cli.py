"""`invoke rollback NAME [--to N]` through the CLI (issue 36: only the choice of the start was tested),
with the engine on this machine (connection: local) and stand-ins for what is not ours on PATH:
`getent` (the login user's home in the test's folder, where the deployment's history is written as
rank 0 keeps it) and `docker` (no container, every other question answered with docker's own error).
What it shows: the CLI finds the history on the hosts, refuses a start that did not pass before
touching anything, and with a start that passed removes the newest start's containers, starts the
recorded one with cluster-up's plays, and, as it cannot serve here (no GPU, no image), says that it
failed again and removed it: exit 2. The lab runs the whole of it (tests/lab/test_readme_commands.py:
`invoke rollback lab-tiny --to 1` on the demo lab)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sparkprov.serving import history
from tests.unit.test_history import ID1, ID2, _record

REPO = Path(__file__).resolve().parents[2]
INVOKE = str(REPO / ".venv" / "bin" / "invoke")
SPEC = {"name": "nat", "model": "lab-tiny", "hosts": ["first"], "tp": 1}
DOCKER = """#!/bin/sh
printf '%s\\n' "$*" >> "$T/docker.log"
case "$1" in
  ps) exit 0 ;;
  *) echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def here(tmp_path):
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    getent = f"#!/bin/sh\n[ \"$1\" = passwd ] && echo \"$(id -un):x:$(id -u):$(id -g)::{home}:/bin/sh\"\n"
    for name, text in {"docker": DOCKER, "getent": getent}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    records = [_record(1, "passed", ID1, SPEC), _record(2, "passed", ID2, {**SPEC, "image_override": "x:2"}),
               _record(3, "failed", ID2, {**SPEC, "image_override": "x:3"})]
    f = home / history.history_file("nat").replace("~/", "", 1)
    f.parent.mkdir(parents=True)
    f.write_text("".join(history.json_line(r) + "\n" for r in records))
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  first: {connection: local}\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), "T": str(tmp_path)}
    env.pop("SPARKPROV_INVENTORY", None)

    def rollback(*args):
        p = subprocess.run([INVOKE, "rollback", "nat", "--inventory", str(inv), *args], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
        return p.returncode, p.stdout, p.stderr
    return rollback, tmp_path


def test_a_start_that_did_not_pass_is_refused_before_anything(here):
    rollback, tmp = here
    rc, out, err = rollback("--to", "3")
    assert rc == 1 and "--to 3: start #3 of nat did not pass its smoke test" in err + out, (out, err)
    assert "fix: give a start that passed (#1, #2)" in err + out
    assert not (tmp / "docker.log").exists() or "run" not in (tmp / "docker.log").read_text()


def test_a_recorded_start_is_started_again_and_removed_when_it_fails_again(here):
    rollback, tmp = here
    rc, out, err = rollback("--to", "1", "--json")
    assert rc == 2, (out[-2000:], err[-2000:])
    doc = json.loads(out)
    assert doc["rollback"]["deployment"] == "nat" and doc["rollback"]["to"] == 1 and not doc["rollback"]["serving"]
    assert doc["rollback"]["message"].startswith("nat: start #1 failed again (") and \
        doc["rollback"]["message"].endswith("): removed"), doc["rollback"]["message"]
    plays = [r["play"] for r in doc["results"]]
    # the newest start's containers removed first, then cluster-up's plays for start #1, then removed again
    assert plays[0] == "cluster-down" and "nat: preflight" in plays and plays[-1] == "cluster-down", plays
    assert not [r for r in doc["results"] if r["module"] == "vllm_container" and r["status"] == "changed"]


def test_without_to_it_goes_back_to_the_last_good_start_of_another_spec(here):
    rollback, _ = here
    rc, out, err = rollback("--json")
    assert rc == 2 and json.loads(out)["rollback"]["to"] == 2, (out[-2000:], err[-2000:])


def test_a_rollback_to_the_start_that_runs_removes_nothing_first(here):
    """--to 2 where the newest start (#3, a rollback to #2) passed with #2's spec: no cluster-down
    before cluster-up's plays (here they cannot start it: it fails and is removed, exit 2)."""
    rollback, tmp = here
    f = next((tmp / "home").rglob("history.jsonl"))
    records = [_record(1, "passed", ID1, SPEC), _record(2, "passed", ID2, {**SPEC, "image_override": "x:2"}),
               _record(3, "passed", ID2, {**SPEC, "image_override": "x:2"}, kind="rollback")]
    f.write_text("".join(history.json_line(r) + "\n" for r in records))
    rc, out, err = rollback("--to", "2", "--json")
    assert rc == 2, (out[-2000:], err[-2000:])
    plays = [r["play"] for r in json.loads(out)["results"]]
    assert plays[0] != "cluster-down" and "nat: preflight" in plays and plays[-1] == "cluster-down", plays

