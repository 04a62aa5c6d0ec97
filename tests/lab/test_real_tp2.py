"""The pinned native tp 2 deployment on the real vLLM (lab-tiny, rank 0 on spark1, rank 1 on spark2,
over the fabric; tests/lab/conftest.py `nat`), shared with the guard's tests before these: its
internals let no one in (issue 27), it recovers from a lost rank and from a power cycle of each node
by itself, and a pinned upgrade to a build that fails its smoke test is rolled back on both nodes
(issue 26). The last test removes it.
Engine: real vLLM in every test of this module."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.lab import lockdown
from tests.lab.conftest import NAT
from tests.lab.test_cluster import cli, ns_processes
from tests.lab import test_real_vllm as real
from tests.lab.test_real_vllm import (INVOKE, MODEL, RECOVERY_BOUND_S, REPO_ROOT, STATUS_BOUND_S, ask, problems,
                                      smoke_within, status_degraded_within, up)

# the real-engine modules' fixtures: the provisioned lab with lab-tiny staged; every deployment but
# the ones a passing test keeps removed after each test
env = real.env
nothing_left_running = real.nothing_left_running


@pytest.mark.keeps_serving(NAT)
def test_native_tp2_internals_are_closed(env, nat):
    """Every socket either node listens on outside loopback is reported by `status --ports` and
    reachable only as it says: rendezvous, Gloo and vLLM's own ports from the other member alone,
    sshd and the keyed API port from everyone; `status --ports` exits 0 (tests/lab/lockdown.py)."""
    lab = env["lab"]
    assert "204" in ask(nat["endpoint"], nat["model"], nat["key"])
    lockdown.assert_locked(lab, env["inv"], NAT, 8000)


def test_native_tp2_recovers_from_a_lost_rank_and_from_reboots(env, nat):
    """With no sparkprov command in between and each time within RECOVERY_BOUND_S: rank 1's vLLM
    killed (status exits 2 within 30 s, without a user's request, naming rank 0's failed token), rank
    0's node rebooted, rank 1's node rebooted (its firewall table loaded again by the boot before
    docker starts). Every rank runs by the registry digest its node holds (--pin). Then a pinned
    upgrade (issue 26) to a build that starts and serves but fails the smoke test (the real vLLM
    answering another question): exit 2, both nodes rolled back to the previous digest, which answers
    204 again; the history shows the three starts with every node's digest. Then `nat` is removed:
    no container and no firewall rule left."""
    lab = env["lab"]
    d, key, ranks = nat, nat["key"], nat["ranks"]
    assert "204" in ask(d["endpoint"], d["model"], key)
    pinned = {h: lab.ssh(h, f"docker inspect --format '{{{{.Config.Image}}}}' {c}").stdout.strip() for h, c in ranks.items()}
    assert pinned["spark1"] == pinned["spark2"] and pinned["spark1"].startswith("sparkprov/lab-vllm-cpu@sha256:"), pinned
    args = lab.ssh("spark2", f"docker inspect --format '{{{{join .Args \" \"}}}}' {ranks['spark2']}").stdout
    assert "--headless" in args and "--node-rank 1" in args and "--master-addr 192.168.100.11" in args, args
    for h in lab.names:  # vLLM's own multi-node: no Ray anywhere
        assert ns_processes(h, ("raylet", "gcs_server", "ray start")) == [], h

    lab.ssh("spark2", f"docker exec {ranks['spark2']} pkill -9 -f '/opt/venv/bin/vllm serve'")
    t0 = time.monotonic()
    secs, st = status_degraded_within(env, STATUS_BOUND_S)
    assert secs is not None, f"status did not exit 2 within {STATUS_BOUND_S}s of rank 1's death: {st}"
    assert any(f"sparkprov-{NAT}-rank" in p for p in problems(st, "spark1", NAT)), problems(st, "spark1", NAT)
    back = smoke_within(d["endpoint"], d["model"], key, RECOVERY_BOUND_S)
    timings = [f"rank 1 killed: status 2 after {secs:.1f}s, serving again after {time.monotonic() - t0:.1f}s"]
    assert back is not None, f"no smoke answer within {RECOVERY_BOUND_S}s after rank 1 was killed"

    table = f"nft list table inet sparkprov-{NAT}"
    rules = {h: lab.sh(h, table).stdout for h in lab.names}
    assert all(rules.values()), rules
    for victim in ("spark1", "spark2"):
        t0 = time.monotonic()
        res = subprocess.run([INVOKE, "lab.fault", "reboot", victim], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        # a power cycle loses the kernel's rules; the boot loads them again before docker starts
        assert lab.sh(victim, table).stdout == rules[victim], victim
        back = smoke_within(d["endpoint"], d["model"], key, RECOVERY_BOUND_S)
        timings.append(f"{victim} rebooted: serving again after {time.monotonic() - t0:.1f}s")
        assert back is not None, f"no smoke answer within {RECOVERY_BOUND_S}s after {victim} rebooted"
    print("\n[real vLLM native tp2] " + "; ".join(timings))
    rc, st, out = cli(env, "status")
    assert rc == 0, out

    from sparklab.image import VLLM_CPU_WRONG_IMAGE, ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [VLLM_CPU_WRONG_IMAGE])
    ran = {h: lab.ssh(h, f"docker inspect --format '{{{{.Image}}}}' {c}").stdout.strip() for h, c in ranks.items()}
    t0 = time.monotonic()
    rc, doc, out = up(env, "--tp", "2", "--hosts", "spark1,spark2", "--executor", "native", "--name", NAT,
                      "--image", VLLM_CPU_WRONG_IMAGE, "--pin")
    took = time.monotonic() - t0
    assert rc == 2, out
    back = doc["cluster"]["deployments"][NAT]["rollback"]
    assert back["serving"] and back["failure"], back
    assert "204" in ask(d["endpoint"], d["model"], key)
    for h, c in ranks.items():
        now = lab.ssh(h, f"docker inspect --format '{{{{.Image}}}} {{{{.Config.Image}}}}' {c}").stdout.split()
        assert now == [ran[h], pinned[h]], (h, now, ran[h])
    rc, hist, out = cli(env, "history", NAT)
    assert rc == 0, out
    was, wrong, again = hist["records"][-3:]
    assert [(r["kind"], r["result"]) for r in (was, wrong, again)] == [
        ("start", "passed"), ("start", "failed"), ("rollback", "passed")], hist
    for h in ranks:
        assert wrong["nodes"][h]["digest"].startswith("sparkprov/lab-vllm-cpu@sha256:"), wrong["nodes"][h]
        assert was["nodes"][h]["digest"] == pinned[h], (was["nodes"][h], pinned[h])
        assert again["nodes"][h]["digest"] == was["nodes"][h]["digest"] != wrong["nodes"][h]["digest"], hist
    print(f"\n[real vLLM native tp2] upgrade to a wrong-answering build: exit 2 after {took:.1f}s, rolled back "
          f"in {back['seconds']:.1f}s")
    rc, _, out = cli(env, "cluster-down", "--model", MODEL, "--name", NAT)
    assert rc == 0, out
    for h in lab.names:
        assert lab.ssh(h, f"docker ps -aq --filter label=sparkprov.deployment={NAT}").stdout == ""
    lockdown.assert_no_rule_left(lab)
