"""The derived image's build end to end on the engine, here (issue 36: claimed, never exercised):
the control machine's pip is asked for the wheels, a pin the index lacks is dropped and the
download tried again, the wheels go up to the host, and a build whose pip fails ends with pip's
own error line, not docker's. What is not ours stands in on PATH (and as the interpreter that
runs `python -m pip`), each replaying a capture: `docker` (the image's probe as the control
machine's venv printed it, tests/fixtures/derived_image; `docker build` as a lab host's docker
printed a failed pip step, tests/fixtures/docker), `getent` (the login user's home in the test's
folder) and pip (its output for a pin the index cannot satisfy, tests/fixtures/pip_download)."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.engine.playbook import Playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import Runner, RunOptions
from sparkprov.plays.book import play, task

FIX = Path(__file__).resolve().parents[1] / "fixtures"
BASE = "vllm/vllm-openai:cu130-nightly"
BASE_ID = "sha256:" + "7" * 64
# the control machine's venv as the image: numpy held at 1.21.0, a version the index has no cp311
# wheel of (pip's own output for it: tests/fixtures/pip_download/constraint_conflict.txt)
PROBE = json.loads((FIX / "derived_image" / "probe_venv_py311_x86_64.txt").read_text().strip().splitlines()[-1])
PROBE["installed"]["numpy"] = "1.21.0"
CONFLICT = FIX / "pip_download" / "constraint_conflict.txt"
WHEELS = ("scipy-1.17.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
          "numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")
# `docker build -q` of the module's Dockerfile whose pip step failed: on a lab host (docker 28's
# client, the legacy builder); and BuildKit's, as posted in kausmees/GenoCAE#36
LEGACY = json.loads((FIX / "docker" / "build-pip-fails-legacy.json").read_text())
BUILDKIT = (FIX / "docker" / "build-pip-fails-buildkit.txt").read_text()

DOCKER = r"""#!/bin/sh
printf '%s\n' "$*" >> "$T/docker.log"
case "$1 $2" in
  "image inspect") case "$*" in
                     *sparkprov/derived:*) [ -f "$T/built" ] || exit 1; echo "sha256:$(printf %064d 8) $BASE_ID" ;;
                     *) echo "$BASE_ID" ;;
                   esac ;;
  "run --rm") cat "$T/probe.json" ;;
  "build --network") cat "$T/build.out"; rc=$(cat "$T/build.rc"); [ "$rc" = 0 ] && touch "$T/built"; exit "$rc" ;;
  *) echo "stand-in docker: unexpected: $*" >&2; exit 2 ;;
esac
"""
# `python -m pip download ... --dest D -c C ...`: pip's real answer to a pin the index lacks, else
# the wheels in D
PIP = r"""#!/bin/sh
printf '%s\n' "$*" >> "$T/pip.log"
while [ $# -gt 0 ]; do case "$1" in --dest) dest=$2; shift ;; -c) cons=$2; shift ;; esac; shift; done
cp "$cons" "$T/constraints.$(wc -l < "$T/pip.log")"
if grep -q '^numpy==1.21.0$' "$cons"; then cat "$CONFLICT"; exit 1; fi
for w in $WHEELS; do printf PK > "$dest/$w"; done
"""


@pytest.fixture
def here(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    getent = f"#!/bin/sh\n[ \"$1\" = passwd ] && echo \"$(id -un):x:$(id -u):$(id -g)::{tmp_path / 'home'}:/bin/sh\"\n"
    for name, text in {"docker": DOCKER, "getent": getent, "pip-python": PIP}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "home").mkdir()
    (tmp_path / "probe.json").write_text(json.dumps(PROBE) + "\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARKPROV_CACHE", str(tmp_path / "cache"))
    for k, v in {"T": tmp_path, "BASE_ID": BASE_ID, "CONFLICT": CONFLICT, "WHEELS": " ".join(WHEELS)}.items():
        monkeypatch.setenv(k, str(v))
    # pip is not ours: the interpreter fetch_wheels runs `-m pip` with is the stand-in
    monkeypatch.setattr(sys, "executable", str(bin_dir / "pip-python"))
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  spark1: {connection: local}\n")
    return load_inventory(inv), tmp_path


def build(inv, builder_output: str, rc: int, tmp: Path) -> Report:
    (tmp / "build.out").write_text(builder_output)
    (tmp / "build.rc").write_text(str(rc))
    where = ("derived", None, None)
    book = Playbook("derived", [play("derived image", ["spark1"], [task(
        "derived image", "derived_image", {"base": BASE, "requirements": ["scipy"]}, where)])])
    report = Report(io.StringIO(), quiet=True)
    Runner(inv, book, ["spark1"], RunOptions(), report).run()
    return report


def failure(report: Report) -> str:
    (bad,) = [r for r in report.results if r.status == "failed"]
    return bad.msg


@pytest.mark.parametrize("said,pip_line", [
    (LEGACY["stdout"] + LEGACY["stderr"], LEGACY["pip_error"]),
    (BUILDKIT, "ERROR: No matching distribution found for and"),
], ids=["legacy builder", "buildkit"])
def test_a_failed_build_ends_with_pips_error_line(here, said, pip_line):
    inv, tmp = here
    report = build(inv, said, 1, tmp)
    assert report.exit_code() == 2
    assert failure(report).endswith(f": {pip_line}"), failure(report)


def test_a_pin_the_index_lacks_is_dropped_and_the_download_tried_again(here):
    inv, tmp = here
    build(inv, LEGACY["stdout"] + LEGACY["stderr"], 1, tmp)
    calls = (tmp / "pip.log").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("-m pip download") and " scipy" in c for c in calls), calls
    first, second = (tmp / "constraints.1").read_text().split(), (tmp / "constraints.2").read_text().split()
    assert "numpy==1.21.0" in first and first == second + ["numpy==1.21.0"] or sorted(first) == sorted(
        second + ["numpy==1.21.0"]), (first, second)
    # what went up to the host: both wheels (numpy at the index's version, not the image's)
    (tar,) = (tmp / "cache" / "wheels").glob("derived-*.tar")
    with tarfile.open(tar) as tf:
        assert sorted(tf.getnames()) == ["wheels"] + sorted(f"wheels/{w}" for w in WHEELS)
    # the build ran from it (the stand-in docker was asked to build the module's tag)
    assert any(line.startswith("build --network none -q -t sparkprov/derived:") for line in
               (tmp / "docker.log").read_text().splitlines())


def test_a_build_that_works_leaves_nothing_failed(here):
    inv, tmp = here
    report = build(inv, "sha256:" + "8" * 64 + "\n", 0, tmp)
    assert report.exit_code() == 0, [(r.status, r.msg) for r in report.results]
