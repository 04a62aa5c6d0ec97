"""The lab and reliability suites never end green by skipping themselves under CI: a missing
prerequisite (root, a tool) fails every lab test and names what is missing; outside CI it is a
skip that names it. Checked by running those suites in a pytest of their own with one of the
lab's tools made absent (PATH holds every other one), so no lab is ever brought up."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab.conftest import LAB_TOOLS

REPO = Path(__file__).resolve().parents[2]
# One test of each suite that uses the lab.
LAB_TESTS = ["tests/lab/test_lab_hosts.py::test_strict_host_keys",
             "tests/reliability/test_rel_faults.py::test_sparkprov_killed_mid_run_then_rerun_converges"]


def _path_without(tool: str, tmp_path: Path) -> str:
    """A PATH with every lab tool this machine has except `tool`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for t in LAB_TOOLS:
        where = shutil.which(t) or (f"/usr/sbin/{t}" if os.access(f"/usr/sbin/{t}", os.X_OK) else None)
        if t != tool and where:
            (bin_dir / t).symlink_to(where)
    return str(bin_dir)


def _run_lab_tests(tmp_path: Path, ci: str | None) -> tuple[int, str, str]:
    # a tool the check cannot find but through PATH (not in /usr/sbin): absent from this PATH
    tool = next(t for t in LAB_TOOLS if not os.access(f"/usr/sbin/{t}", os.X_OK))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PATH"] = _path_without(tool, tmp_path)
    if ci is not None:
        env["CI"] = ci
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *LAB_TESTS],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr, tool


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_missing_lab_tool_fails_every_lab_test_and_names_it(tmp_path, ci):
    code, out, tool = _run_lab_tests(tmp_path, ci)
    assert code == 1, out
    assert "skipped" not in out, out
    summary = out.strip().splitlines()[-1]
    assert re.search(rf"\b{len(LAB_TESTS)} errors?\b", summary) and "passed" not in summary, out
    assert out.count("lab prerequisite missing under CI") >= len(LAB_TESTS), out
    assert f"{tool} (not installed: make deps)" in out, out


def test_outside_ci_a_missing_lab_tool_is_a_skip_that_names_it(tmp_path):
    code, out, tool = _run_lab_tests(tmp_path, None)
    assert code == 0, out
    assert f"{len(LAB_TESTS)} skipped" in out, out
    skips = [l for l in out.splitlines() if l.startswith("SKIPPED")]
    assert skips, out
    for line in skips:
        assert "lab prerequisite missing: " in line and f"{tool} (not installed: make deps)" in line, out
