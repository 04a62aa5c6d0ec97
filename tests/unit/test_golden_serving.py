"""Every serving command sparkprov renders, against the golden file (tests/fixtures/golden/make.py
says how it was made): the `docker run` argv, environment, labels and recipe hash of every catalog
recipe x layout x rank, and what `invoke recipe --argv` prints. A running container whose recipe
hash label equals its case's is left running by cluster-up: a difference here replaces it."""

from __future__ import annotations

import difflib
import json

import pytest

from tests.fixtures.golden import make

GOLDEN = json.loads(make.OUT.read_text())


@pytest.fixture(scope="module")
def rendered():
    return make.render_all()


def _diff(want, got) -> str:
    a = json.dumps(want, indent=1, sort_keys=True).splitlines()
    b = json.dumps(got, indent=1, sort_keys=True).splitlines()
    return "\n".join(list(difflib.unified_diff(a, b, "golden", "rendered", lineterm=""))[:60])


@pytest.mark.parametrize("section", ["recipe", "deployments", "variants"])
def test_every_case_renders_as_recorded(rendered, section):
    assert sorted(rendered[section]) == sorted(GOLDEN[section])
    for key, want in GOLDEN[section].items():
        assert rendered[section][key] == want, f"{section} {key!r}:\n{_diff(want, rendered[section][key])}"


def test_the_golden_file_covers_every_recipe_and_role():
    aliases = {k.split(" | ")[0] for k in GOLDEN["deployments"]}
    assert aliases == set(GOLDEN["recipe"])
    roles = {(c["role"], c["labels"].get("sparkprov.executor")) for d in GOLDEN["deployments"].values()
             for c in d.values()}
    assert roles == {("server", None), ("ray-head", "ray"), ("ray-worker", "ray"), ("rank0", "native"),
                     ("rank", "native")}
    assert all(c["labels"]["sparkprov.recipe_hash"] == c["hash"] for d in GOLDEN["deployments"].values()
               for c in d.values())


@pytest.mark.parametrize("case", ["qwen3.6-27b | tp 1", "llama-3.3-70b | tp 2 (ray)", "lab-tiny | tp 2 (native)"])
def test_a_container_with_its_golden_hash_is_left_running(case):
    """cluster-up's container play (node_container, then vllm_container) on a node whose container
    carries the golden file's recipe hash (as one started by an earlier sparkprov does): nothing to
    change, so a run costs the gather alone."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.modules.base import HostContext
    from tests.unit.test_serving_modules import container_play

    inv = load_inventory(make.INVENTORY)
    alias, layout = case.split(" | ")
    hosts = list(GOLDEN["deployments"][case])
    tp = 2 if layout.startswith("tp 2") else 1
    dep = {"name": alias.replace(".", "-")[:40], "model": alias, "hosts": hosts, "tp": tp,
           **({"executor": layout.split("(")[1].rstrip(")")} if "(" in layout else {})}
    exports = {hosts[0]: {"serve_preflight": {dep["name"]: {"node_ip": str(inv.host_vars(hosts[0])["fabric_ip"])}},
                          "containers": {dep["name"]: {"id": make.RANK0_ID}}}}
    for h, want in GOLDEN["deployments"][case].items():
        running = {"name": want["name"], "id": "f" * 64, "status": "running", "labels": want["labels"]}
        host = HostContext(h, inv.host_vars(h), {"user": "nvidia", "home": make.HOME}, check=False, exports=exports,
                           play_hosts=hosts, become=False)
        values = {"containers": {"access": True, "error": None, "containers": [running]}, "smi": make.SMI,
                  "ollama": {"models": []}, "fabric": make.FABRIC}
        plan = container_play({"deployment": dep}, values, host)
        assert plan.failed is None and not plan.changes, (h, plan.failed, [c.summary for c in plan.changes])
        assert plan.exports["containers"][dep["name"]]["hash"] == want["hash"]
