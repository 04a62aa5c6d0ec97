"""A failed `docker run` says docker's cause, not its last line (issue 36: `invoke monitor up` on
the demo lab said only "See 'docker run --help'"). The scripts sparkprov runs are run here, in a
shell, with a stand-in `docker` on PATH replaying what docker printed on a lab host
(tests/fixtures/docker/README.md names each capture)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sparkprov.facts.docker_run import FAILED, cause_of, reporting_cause
from sparkprov.transport.shell import cmd

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "docker"
NO_IMAGE = json.loads((FIX / "run-125-no-image.json").read_text())      # prom/prometheus:v3.5.0, no registry
NO_COMMAND = json.loads((FIX / "run-127-no-command.json").read_text())  # a command the image lacks


def stand_in(tmp_path: Path, capture: dict) -> dict[str, str]:
    """PATH with a `docker` that answers `run` as the capture did (its stdout, stderr, exit status)
    and every other subcommand with success; the environment to run a script in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "out").write_text(capture["stdout"])
    (tmp_path / "err").write_text(capture["stderr"])
    (bin_dir / "docker").write_text(f"""#!/bin/sh
[ "$1" = run ] || exit 0
cat {tmp_path / 'out'}; cat {tmp_path / 'err'} >&2; exit {capture['rc']}
""")
    (bin_dir / "docker").chmod(0o755)
    (tmp_path / "home").mkdir(exist_ok=True)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path / "home")}


def sh(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """As the engine runs a step: `set -e`, in a subshell."""
    return subprocess.run(["sh", "-c", f"( set -e\n{script}\n)"], capture_output=True, text=True, env=env, timeout=60)


def cause_line(capture: dict) -> str:
    return next(line for line in capture["stderr"].splitlines() if line.startswith("docker: "))


@pytest.mark.parametrize("capture", [NO_IMAGE, NO_COMMAND], ids=["125 no image", "127 no command"])
def test_a_failed_run_ends_with_dockers_cause_and_its_status(tmp_path, capture):
    r = sh(reporting_cause(cmd("docker", "run", "--rm", "img", "--version")) + " >/dev/null", stand_in(tmp_path, capture))
    assert r.returncode == capture["rc"]
    assert r.stderr.startswith(capture["stderr"]), r.stderr  # what docker said, as it said it
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"{FAILED} (exit {capture['rc']}): {cause_line(capture)}"
    assert cause_of(r.stderr) == last


def test_a_run_that_works_passes_its_output_through_and_says_nothing_more(tmp_path):
    ok = {"rc": 0, "stdout": "prometheus, version 2.42.0\n", "stderr": ""}
    r = sh(reporting_cause(cmd("docker", "run", "--rm", "img", "--version")), stand_in(tmp_path, ok))
    assert (r.returncode, r.stdout, r.stderr) == (0, ok["stdout"], "")


def test_a_program_that_fails_in_its_container_is_named_by_its_own_last_line(tmp_path):
    """No `docker:` line: the container ran and its program failed; the usage hint is never the cause."""
    failed = {"rc": 3, "stdout": "", "stderr": "Traceback (most recent call last):\nValueError: no such size\n"}
    r = sh(reporting_cause(cmd("docker", "run", "img")), stand_in(tmp_path, failed))
    assert r.returncode == 3 and r.stderr.strip().splitlines()[-1] == f"{FAILED} (exit 3): ValueError: no such size"


def test_monitor_up_on_a_host_without_the_image_says_why(tmp_path):
    """The reported case: Prometheus's container on a lab host whose registry lacks the image."""
    from sparkprov.serving import prometheus as prom

    script = prom.up_script(image="prom/prometheus:v3.5.0", port=9090, bind="192.168.100.11",
                            files={"prometheus.yml": "global: {}\n"}, digest="d", timeout=5)
    r = sh(script, stand_in(tmp_path, NO_IMAGE))
    assert r.returncode == 125
    assert r.stderr.strip().splitlines()[-1] == f"{FAILED} (exit 125): {cause_line(NO_IMAGE)}", r.stderr


def test_gateway_up_on_a_host_without_the_image_says_why(tmp_path):
    from sparkprov.serving import gateway as gw

    script = gw.up_script(image=gw.IMAGE, port=4000, bind="0.0.0.0", config=gw.litellm_config([], {}), digest="d",
                          timeout=5)
    r = sh(script, stand_in(tmp_path, NO_IMAGE))
    assert r.returncode == 125
    assert r.stderr.strip().splitlines()[-1] == f"{FAILED} (exit 125): {cause_line(NO_IMAGE)}", r.stderr


def test_the_gpu_smoke_test_names_dockers_cause_before_the_fix(tmp_path):
    from sparkprov.facts.runtimes import DockerState, GpuSmokeRecord
    from sparkprov.modules import gpu_smoke
    from sparkprov.modules.base import FactView, HostContext

    host = HostContext("spark1", {"smoke_image": "sparkprov/smoke:latest"}, {"user": "nvidia", "home": "/home/nvidia"},
                       check=False, exports={}, play_hosts=["spark1"], become=False)
    args = gpu_smoke.Args()
    m = gpu_smoke.GpuSmoke()
    facts = {DockerState().key: {"access": True}, GpuSmokeRecord("sparkprov/smoke:latest", (), True).key:
             {"state": "present", "key": "k" * 32, "passed": False}}
    (change,) = m.plan(args, m.view(args, FactView(facts, {}), host), host).changes
    r = sh(change.script, stand_in(tmp_path, NO_IMAGE))
    assert r.returncode == 125
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"docker run --rm --gpus all sparkprov/smoke:latest: {FAILED} (exit 125): "
                           f"{cause_line(NO_IMAGE)} (fix: "), last
