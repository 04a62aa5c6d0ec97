"""Convergence from damage: a provisioned, staged lab is damaged behind sparkprov's back with a
seeded random choice of damages (each on a random host); provision and stage-weights must repair
every one, report exactly the damaged tasks as changed (nothing else), and a run after that
changes nothing. The state is read back with plain commands inside the hosts.

The seed is printed; rerun a failure with SPARKPROV_DAMAGE_SEED=<seed>.
"""
# Engine: none: no model is served in this module.
from __future__ import annotations

import io
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report

from ._lab import NETPLAN, NUM, RAILS, changed, converge, problems, provision, write_inventory

pytestmark = [pytest.mark.lab, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("SPARKPROV_DAMAGE_SEED", "20251122"))
ROUNDS = 2
HUB_IP = "10.77.0.1"
STAGE_STORE = "~/relstage"
MODEL = "reltest/damage-mini"
MiB = 1024 * 1024


@dataclass
class Damage:
    name: str
    task: str                      # the task that must report the repair
    fragment: str                  # what its message must say
    apply: Callable                # (lab, host, ctx) -> None
    repaired: Callable             # (lab, host, ctx) -> bool, read with plain commands
    group: str = ""                # damages of one group are not combined on one host


def _sh(lab, host, script):
    return lab.sh(host, script)


def _blob(ctx) -> tuple[str, str]:
    shard = next(f for p, f in ctx["repo"].files.items() if p.endswith(".safetensors"))
    folder = "models--" + MODEL.replace("/", "--")
    return f"/home/nvidia/relstage/hub/{folder}/blobs/{shard.sha256}", shard.sha256


DAMAGES = [
    Damage("user removed from the docker group", "docker and GPU containers", "add nvidia to group docker",
           lambda lab, h, c: _sh(lab, h, "gpasswd -d nvidia docker >/dev/null"),
           lambda lab, h, c: "docker" in _sh(lab, h, "id -nG nvidia").stdout.split()),
    Damage("model store deleted", "model store and compile cache", "create the model store (HF_HOME) /home/nvidia/vllm",
           lambda lab, h, c: _sh(lab, h, "rm -rf /home/nvidia/vllm"),
           lambda lab, h, c: _sh(lab, h, "stat -c '%U %a' /home/nvidia/vllm /home/nvidia/vllm/hub").stdout
           == "nvidia 755\nnvidia 755\n", group="store"),
    Damage("model store hub chowned to root", "model store and compile cache", "owned by others back to nvidia",
           lambda lab, h, c: _sh(lab, h, "chown root:root /home/nvidia/vllm/hub"),
           lambda lab, h, c: _sh(lab, h, "stat -c '%U' /home/nvidia/vllm/hub").stdout == "nvidia\n", group="store"),
    Damage("compile cache chowned to root", "model store and compile cache", "owned by others back to nvidia",
           lambda lab, h, c: _sh(lab, h, "chown -R root:root /home/nvidia/vllm-compile-cache"),
           lambda lab, h, c: _sh(lab, h, "stat -c '%U' /home/nvidia/vllm-compile-cache").stdout == "nvidia\n"),
    Damage("MTU reset on rail 1", "fabric rails", "enp1s0f1np1: mtu 1500 -> 9000",
           lambda lab, h, c: _sh(lab, h, "ip link set dev enp1s0f1np1 mtu 1500"),
           lambda lab, h, c: "mtu 9000" in _sh(lab, h, "ip -o link show enp1s0f1np1").stdout),
    Damage("fabric address removed from rail 2", "fabric rails", "enP2p1s0f1np1: add 192.168.101.",
           lambda lab, h, c: _sh(lab, h, "ip addr flush dev enP2p1s0f1np1 scope global"),
           lambda lab, h, c: f"inet {RAILS['enP2p1s0f1np1']}.{NUM[h]}/24"
           in _sh(lab, h, "ip -o -4 addr show dev enP2p1s0f1np1").stdout),
    Damage("netplan file mode changed", "fabric rails", f"update {NETPLAN} (mode 0600",
           lambda lab, h, c: _sh(lab, h, f"chmod 0644 {NETPLAN}"),
           lambda lab, h, c: _sh(lab, h, f"stat -c '%a %U' {NETPLAN}").stdout == "600 root\n"),
    Damage("weight shard truncated", "send", "send 1 files",
           lambda lab, h, c: _sh(lab, h, f"truncate -s 4096 {_blob(c)[0]}"),
           lambda lab, h, c: _sh(lab, h, f"sha256sum < {_blob(c)[0]}").stdout.split()[0] == _blob(c)[1]),
]


@pytest.fixture(scope="module")
def hub():
    from sparklab.hub import RepoSpec, ensure_generated, start_in_thread
    from sparklab.hub.manage import default_root

    root = default_root()
    repo = ensure_generated(RepoSpec(MODEL, num_shards=2, total_size=4 * MiB), root)
    server = start_in_thread([repo], bind=HUB_IP, port=0)
    yield server, repo
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def site(lab, hub, tmp_path_factory):
    """The lab provisioned (converged) and the model staged on both hosts."""
    d = tmp_path_factory.mktemp("damage")
    inv = write_inventory(lab, d / "inventory.yaml")
    # the control machine is the source (it downloads once), the Sparks receive over SSH
    stage_inv = d / "stage.yaml"
    doc = yaml.safe_load(inv.read_text())
    doc["hosts"] = {"localhost": {"connection": "local", "vars": {"model_store": str(d / "store")}}, **doc["hosts"]}
    doc["vars"].update(model_store=STAGE_STORE, hf_endpoint=hub[0].url)
    stage_inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    converge(inv)
    rep = stage(stage_inv)
    assert rep.exit_code() == 0, problems(rep)
    yield {"inv": inv, "stage_inv": stage_inv, "repo": hub[1], "dir": d}
    for h in lab.names:
        lab.sh(h, "rm -rf /home/nvidia/relstage")


def stage(inv: Path) -> Report:
    from sparkprov.plays.stage import StageOptions, run_stage

    inventory = load_inventory(inv)
    report = Report(io.StringIO())
    old = os.environ.get("HF_TOKEN_PATH")
    os.environ["HF_TOKEN_PATH"] = str(inv.parent / "no-token")
    try:
        run_stage(inventory, list(inventory.hosts), MODEL, StageOptions(), report)
    finally:
        if old is None:
            os.environ.pop("HF_TOKEN_PATH", None)
        else:
            os.environ["HF_TOKEN_PATH"] = old
    return report


def choose(rng: random.Random, hosts: list[str]) -> list[tuple[Damage, str]]:
    """Three to five damages, each on a random host; two of one group never on one host."""
    picks: list[tuple[Damage, str]] = []
    for d in rng.sample(DAMAGES, rng.randint(3, 5)):
        h = rng.choice(hosts)
        if d.group and any(p.group == d.group and ph == h for p, ph in picks):
            continue
        picks.append((d, h))
    return picks


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_random_damage_is_repaired_reported_and_nothing_else_changes(lab, site, round_):
    seed = SEED + round_
    picks = choose(random.Random(seed), lab.names)
    print(f"damage seed {seed}: " + "; ".join(f"{d.name} on {h}" for d, h in picks))
    for d, h in picks:
        d.apply(lab, h, site)
        assert not d.repaired(lab, h, site), f"{d.name} on {h} did not damage anything"

    t0 = time.monotonic()
    prov = provision(site["inv"])
    staged = stage(site["stage_inv"])
    print(f"repair runs: {time.monotonic() - t0:.1f}s")
    assert not problems(prov) and not problems(staged), (seed, problems(prov), problems(staged))

    want_prov = {(h, d.task) for d, h in picks if d.task != "send"}
    got_prov = changed(prov)
    assert set(got_prov) == want_prov, (seed, got_prov)
    # a damaged shard: the source sends it again, the damaged host publishes it; nothing else moves
    stage_hosts = {h for d, h in picks if d.task == "send"}
    got_stage = changed(staged)
    assert {h for h, t in got_stage if t.startswith("publish")} == stage_hosts, (seed, got_stage)
    sends = " | ".join(m for (h, t), m in got_stage.items() if t.startswith("send"))
    # (the damaged host's store check removes the truncated file first, so the right bytes publish)
    assert {h for h, t in got_stage if t.startswith("store")} <= stage_hosts, (seed, got_stage)
    assert {h for h, t in got_stage if not t.startswith(("publish", "send", "store"))} == set(), (seed, got_stage)
    for d, h in picks:
        if d.task == "send":
            assert d.fragment in sends and f"to {h} " in sends, (seed, got_stage)
        else:
            assert d.fragment in got_prov[(h, d.task)], (seed, d.name, got_prov[(h, d.task)])
        assert d.repaired(lab, h, site), f"seed {seed}: {d.name} on {h} not repaired"

    again = provision(site["inv"])
    assert not problems(again) and not changed(again), (seed, changed(again), problems(again))
    restaged = stage(site["stage_inv"])
    assert restaged.exit_code() == 0 and not changed(restaged), (seed, changed(restaged))
