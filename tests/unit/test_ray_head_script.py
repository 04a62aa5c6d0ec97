"""The Ray head's start script (serving/spec.py HEAD_SCRIPT) run by sh with a stand-in `ray` and
`sleep` on PATH: it waits for the workers' GPUs without a bound, but leaves (exit 75, for the
container's restart policy) when Ray itself stops answering on the head: RAY_GONE_CHECKS failed
`ray status` in a row. Seen in the lab: the head's GCS and raylet were SIGKILLed while it waited,
and without this the container stayed up, waiting, with no Ray, until someone came."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sparkprov.serving import spec

# `ray status` as Ray prints it once every node has joined (the lab's Ray 2.60, trimmed)
STATUS_2_GPUS = """======== Autoscaler status: 2026-11-28 20:43:50 ========
Node status
---------------------------------------------------------------
Active:
 1 node_bcb528e9be20c0d30f514a8e43d145de0a2502f110b244f050e39db4
 1 node_28de0fbeaab1e675a938f97e88a287c438f7bdaca6f1ddee640af11a
Resources
---------------------------------------------------------------
Usage:
 0.0/4.0 CPU
 0.0/2.0 GPU
"""
STATUS_1_GPU = STATUS_2_GPUS.replace(" 0.0/2.0 GPU", " 0.0/1.0 GPU")

FAKE_RAY = """#!/bin/sh
# `ray start` succeeds; each `ray status` takes the next answer from $ANSWERS ("fail" or a file)
echo "$*" >> "$CALLS"
[ "$1" = status ] || exit 0
n=$(grep -c '^status' "$CALLS")
a=$(sed -n "${n}p" "$ANSWERS")
[ -n "$a" ] && [ "$a" != fail ] || exit 1
cat "$a"
"""


def run_head(tmp_path: Path, answers: list[str]) -> tuple[subprocess.CompletedProcess, int]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(FAKE_RAY)
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    files = {"2": STATUS_2_GPUS, "1": STATUS_1_GPU}
    lines = []
    for a in answers:
        if a == "fail":
            lines.append("fail")
        else:
            p = tmp_path / f"status{a}"
            p.write_text(files[a])
            lines.append(str(p))
    (tmp_path / "answers").write_text("\n".join(lines) + "\n")
    script = spec.HEAD_SCRIPT.replace("@PRE_SERVE@", ":").replace("@KEY@", ":")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
           "ANSWERS": str(tmp_path / "answers"), "SPARKPROV_RAY_GPUS": "2", "VLLM_HOST_IP": "192.168.100.11",
           "SPARKPROV_RAY_PORT": "6379"}
    p = subprocess.run(["sh", "-c", script, "sh", "echo", "vllm serve ran"], env=env, capture_output=True,
                       text=True, timeout=30)
    calls = (tmp_path / "calls").read_text().splitlines()
    return p, sum(1 for c in calls if c.startswith("status"))


def test_the_head_leaves_when_ray_stops_answering(tmp_path):
    p, statuses = run_head(tmp_path, ["1"] + ["fail"] * 10)
    assert p.returncode == 75, (p.returncode, p.stderr)
    assert statuses == 1 + spec.RAY_GONE_CHECKS
    assert f"ray status failed {spec.RAY_GONE_CHECKS} times in a row" in p.stderr
    assert "vllm serve ran" not in p.stdout


def test_the_head_waits_for_the_workers_through_failures_that_are_not_in_a_row(tmp_path):
    answers = (["fail"] * (spec.RAY_GONE_CHECKS - 1) + ["1"]) * 3 + ["2"]
    p, statuses = run_head(tmp_path, answers)
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert statuses == len(answers)
    assert "vllm serve ran" in p.stdout and "Ray has 2 GPUs" in p.stderr
