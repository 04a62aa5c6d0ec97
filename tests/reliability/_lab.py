"""What the reliability tests share: an inventory for the lab, provision runs in process and as
`invoke provision` processes, results by host and task, and plain reads of a lab host's state."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import yaml

from sparkprov.data.inventory import load_inventory
from sparkprov.data.playbook import load_playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import Runner, RunOptions

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = REPO / "playbooks" / "provision.yaml"
NETPLAN = "/etc/netplan/40-sparkprov-fabric.yaml"
RAILS = {"enp1s0f1np1": "192.168.100", "enP2p1s0f1np1": "192.168.101"}
NUM = {"spark1": 11, "spark2": 12}
STORE = "/home/nvidia/vllm"


def write_inventory(lab, path: Path, *, known_hosts: Path | None = None, extra_vars: dict | None = None,
                    store: str = "~/vllm") -> Path:
    return lab.write_inventory(path, known_hosts=known_hosts, store=store, extra_vars=extra_vars)


def provision(inv: Path, hosts: list[str] | None = None, **opts) -> Report:
    report = Report(io.StringIO())
    inventory = load_inventory(inv)
    Runner(inventory, load_playbook(PLAYBOOK), hosts or list(inventory.hosts), RunOptions(**opts), report).run()
    return report


def changed(report: Report) -> dict[tuple[str, str], str]:
    return {(r.host, r.task): r.msg for r in report.results if r.status == "changed"}


def problems(report: Report) -> list[tuple[str, str, str, str]]:
    return [(r.host, r.task, r.status, r.msg) for r in report.results if r.status in ("failed", "unreachable")]


def invoke_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "invoke", "--search-root", str(REPO), *args]


def invoke_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def run_invoke(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(invoke_argv(*args), capture_output=True, text=True, timeout=timeout,
                          env=env or invoke_env(), cwd=REPO)


def converge(inv: Path) -> Report:
    """Provision until a run changes nothing (at most three runs); that run's report."""
    for _ in range(3):
        report = provision(inv)
        assert not problems(report), problems(report)
        if not changed(report):
            return report
    raise AssertionError(f"provision does not converge: {changed(report)}")


# -- serving (cluster-up) on the lab: the lab hub's catalog repos, the catalog's TP=2 recipe ---------
LAB_HUB = "http://10.77.0.1:8080"   # `invoke lab.up`'s hub: every catalog repo, gated ones behind the lab token
TP_MODEL = "llama-3.3-70b"          # gated in the catalog (meta-llama), TP 2 across spark1 + spark2
TP_REPO = "meta-llama/Llama-3.3-70B-Instruct"
MANAGED = "sparkprov.managed=1"


def lab_hub_token(lab) -> str:
    """The lab hub's token, the hub started as `invoke lab.up` starts it if it is not serving (the session's
    lab comes up without it: tests/lab/conftest.py lab_session)."""
    from sparklab.hub import ensure_lab_hub, lab_token
    from sparklab.state import BRIDGE_IP, HUB_PORT

    url = ensure_lab_hub(lab.state_dir, BRIDGE_IP, HUB_PORT)
    assert url == LAB_HUB, f"the lab hub serves on {url}, not {LAB_HUB}"
    return lab_token(lab.state_dir)


def token_file(path: Path, token: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, token.encode() + b"\n")
    os.close(fd)
    return path


def serve_playbook(path: Path, name: str) -> Path:
    path.write_text(yaml.safe_dump({"deployments": [{"name": name, "model": TP_MODEL, "hosts": ["spark1", "spark2"],
                                                     "tp": 2}]}))
    return path


def cli_env(token_path: Path | None = None) -> dict[str, str]:
    """The environment of `invoke` as a user runs it: the HF token only in a 0600 file."""
    env = invoke_env()
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "SPARKPROV_BECOME_PASSWORD"):
        env.pop(k, None)
    env["HF_TOKEN_PATH"] = str(token_path) if token_path else "/nonexistent/hf-token"
    return env


def managed_containers(lab, host: str) -> list[str]:
    """sparkprov-labelled containers on a host, running or not (read with plain docker inside the host)."""
    out = lab.sh(host, f"docker ps -a --filter label={MANAGED} --format '{{{{.Names}}}}'")
    assert out.returncode == 0, out.stderr
    return sorted(out.stdout.split())
