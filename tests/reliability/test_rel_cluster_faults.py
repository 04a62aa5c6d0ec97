"""A fault before serving: a host's dockerd killed (crashed) before `invoke cluster-up` of the
catalog's TP=2 recipe across spark1 and spark2. cluster-up must fail naming that host and the
cause, and start nothing anywhere (no sparkprov-labelled container on any host: the head on
the healthy host is not started either); with dockerd back, the same command brings the cluster
up; cluster-down leaves nothing. All through `invoke`, as a user runs it."""
# Engine: the stand-in (Spark recipes; faults injected into sparkprov's own runs).
from __future__ import annotations

import pytest

from ._lab import (LAB_HUB, TP_MODEL, cli_env, converge, lab_hub_token, managed_containers, run_invoke,
                   serve_playbook, token_file, write_inventory)

pytestmark = [pytest.mark.lab, pytest.mark.slow]

STORE = "~/relcluster"


@pytest.fixture(scope="module")
def served(lab, tmp_path_factory):
    """The lab provisioned, the TP model staged (gated: the lab hub's token in a 0600 file)."""
    d = tmp_path_factory.mktemp("relcluster")
    env = cli_env(token_file(d / "hf-token", lab_hub_token(lab)))
    inv = write_inventory(lab, d / "inventory.yaml", store=STORE, extra_vars={"hf_endpoint": LAB_HUB})
    pb = serve_playbook(d / "cluster.yaml", "relfault")
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}")  # the serving images in the lab registry (lab.up does not push them)
    converge(inv)
    staged = run_invoke("stage-weights", TP_MODEL, "--inventory", str(inv), env=env)
    assert staged.returncode == 0, staged.stdout[-3000:] + staged.stderr[-2000:]
    down = run_invoke("cluster-down", "--inventory", str(inv), env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    yield {"inv": inv, "pb": pb, "env": env}
    run_invoke("cluster-down", "--inventory", str(inv), env=env)
    for h in lab.names:
        lab.sh(h, f"rm -rf /home/nvidia/{STORE[2:]}")


def _up(served, timeout=420):
    return run_invoke("cluster-up", "--inventory", str(served["inv"]), "--playbook", str(served["pb"]), "--tp", "2",
                      "--ray-timeout", "120", "--health-timeout", "180", env=served["env"], timeout=timeout)


def test_dockerd_killed_before_cluster_up_fails_naming_the_host_and_starts_nothing(lab, served):
    from sparklab import dockerd, faults

    victim, healthy = "spark2", "spark1"
    assert "killed" in faults.kill_dockerd(victim)
    try:
        res = _up(served, timeout=300)
        left = {h: managed_containers(lab, h) for h in [healthy]}  # the victim's docker cannot answer now
    finally:
        faults.start_dockerd(victim)
        dockerd.wait_dockerd(victim)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    failed = [ln for ln in res.stdout.splitlines() if "| failed" in ln]
    assert failed and all(ln.startswith(f"{victim} ") for ln in failed), out      # only the victim fails ...
    assert any(ln.startswith(f"{healthy} ") and "any_errors_fatal" in ln for ln in res.stdout.splitlines()), out
    assert any(f"{victim}: dockerd is down: " in ln and "(fix: start docker on the host" in ln
               for ln in failed), out                                                 # ... naming host, cause, fix
    assert "PLAY RECAP" in out and "relfault: llama-3.3-70b (TP 2, ray) on spark1, spark2: failed" in out, out
    # nothing half-started: no head on the healthy host, and nothing on the victim once docker answers again
    assert left == {healthy: []}, left
    assert {h: managed_containers(lab, h) for h in lab.names} == {h: [] for h in lab.names}

    res = _up(served)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "relfault: llama-3.3-70b (TP 2, ray) on spark1, spark2: started" in out, out[-3000:]
    assert managed_containers(lab, "spark1") == ["sparkprov-relfault-head"]
    assert managed_containers(lab, "spark2") == ["sparkprov-relfault-worker"]

    down = run_invoke("cluster-down", "--inventory", str(served["inv"]), env=served["env"])
    assert down.returncode == 0, down.stdout + down.stderr
    assert {h: managed_containers(lab, h) for h in lab.names} == {h: [] for h in lab.names}
