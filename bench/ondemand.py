"""Benchmark: what an on-demand start costs over a bare start (issue 35), on the lab's real vLLM.

    sudo .venv/bin/python bench/ondemand.py [--runs 3] [--json] [--keep]

Brings up a lab of two hosts (with dockerd), the real vLLM's image and the gateway's pushed,
provisions it (the node guard), stages lab-tiny on both, parks `od` (lab-tiny on spark1, on demand,
idle_stop_s 10, served as lab-tiny-od) and starts `gateway up --host spark1` (LiteLLM with sparkprov's
hook). Then, `--runs` times:

  (setup)      one request for od through the gateway, its first (LiteLLM's own first-call setup and
               od's first start), and one cluster-up of cu (its image pulled onto spark2): in no
               figure below
  activation   od parked (the hook stopped it idle): one request for lab-tiny-od through the
               gateway (max_tokens 1, not streamed: its answer is its first token), from sending
               it to its answer; the hook holds it while spark1's guard starts od
  warm         the same request again at once (od serving)
  bare start   od parked again (the hook stopped it idle): `docker start sparkprov-od` on spark1
               (one ssh command) and a one-token completion on od's own port every 0.2 s until
               one is answered, from the ssh command's start
  cluster-up   `invoke cluster-up --model lab-tiny --hosts spark2 --name cu --json` (a deployment
               not on demand; it returns once it answered its smoke question), as a user waits
               for it (Python's start included); then cluster-down
  bare run     `docker run` of the argv `invoke recipe --alias lab-tiny --host spark2 --argv`
               prints, on spark2 (one ssh command), and a one-token completion on its port every
               0.2 s until one is answered; then `docker rm -f`

Each pair runs in the same round, so they share the machine's noise (two cores: the engines take
~30-40 s to load). Overheads: activation - bare start (issue 35's goal: at most 5 s), cluster-up -
bare run. The lab is taken down at the end (--keep leaves it up). `--json` writes
results/ondemand-DATE.json.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import date
from pathlib import Path

import yaml

from _common import REPO, lab_bench_args, lab_down, machine, median, stamped_report, write_result

INVOKE = str(REPO / ".venv" / "bin" / "invoke")
MODEL = "lab-tiny"
OD_MODEL = "lab-tiny-od"
IDLE_STOP_S = 10          # the least a playbook allows: each run waits for the hook's idle stop
BOUND_S = 330
PLAYBOOK = yaml.safe_dump({"deployments": [{
    "name": "od", "model": MODEL, "hosts": "spark1", "port": 8001, "on_demand": True, "idle_stop_s": IDLE_STOP_S,
    "overrides": {"--served-model-name": OD_MODEL}}]}, sort_keys=False)


def cli(inv: Path, *args: str, timeout: float = 900) -> tuple[float, dict]:
    t0 = time.monotonic()
    p = subprocess.run([INVOKE, *args, "--inventory", str(inv), "--json"], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    took = time.monotonic() - t0
    if p.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} exited {p.returncode}: {p.stdout[-2000:]} {p.stderr[-2000:]}")
    try:
        return took, json.loads(p.stdout)
    except ValueError:
        return took, {}


class Lab:
    def __init__(self):
        from sparklab import state

        self.key, self.known = state.key_path(), state.known_hosts_path()
        self.addr = {"spark1": "10.77.0.11", "spark2": "10.77.0.12"}

    def ssh(self, host: str, cmd: str, check: bool = True) -> str:
        p = subprocess.run(["ssh", "-i", str(self.key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o",
                            "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known}", "-o",
                            "GlobalKnownHostsFile=/dev/null", f"nvidia@{self.addr[host]}", cmd],
                           capture_output=True, text=True, timeout=300)
        if check and p.returncode != 0:
            sys.exit(f"{host}: {cmd[:200]}: exit {p.returncode}: {p.stderr[-1000:]}")
        return p.stdout

    def state(self, host: str, name: str) -> str:
        return self.ssh(host, f"docker inspect --format '{{{{.State.Status}}}}' {name}", check=False).strip()


def one_token(base: str, model: str, key: str, timeout: float = 30) -> bool:
    """A one-token completion answered (the hook's own probe: node/activate.py one_token)."""
    req = urllib.request.Request(f"{base}/completions", method="POST",
                                 data=json.dumps({"model": model, "prompt": "1", "max_tokens": 1}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout) as r:
            return r.status == 200 and bool(json.loads(r.read())["choices"])
    except (OSError, ValueError, KeyError):
        return False


def first_token_through(endpoint: str, model: str, key: str) -> float:
    """Seconds from sending one chat request (max_tokens 1) through the gateway to its answer (the
    epochs of both in LAST, for the phases)."""
    body = json.dumps({"model": model, "max_tokens": 1, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is 12*17?"}]}).encode()
    req = urllib.request.Request(endpoint + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    t0, LAST["sent"] = time.monotonic(), time.time()
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=BOUND_S) as r:
        doc = json.loads(r.read())
    took, LAST["answered"] = time.monotonic() - t0, time.time()
    assert doc["choices"], doc
    return took


LAST: dict[str, float] = {}


def phases(lab: Lab, sent: float, answered: float) -> dict:
    """Where an activation's time went (one clock: the lab's hosts and the gateway's container are
    namespaces of this machine): the hook's view (its `activate` event, just before it asks the guard;
    its `serving` event, at the first token its probe got) and the guard's journal (its start, written
    when docker's start returned), against the request's sending and its answer."""
    from sparkprov.serving import gateway as gw

    view = json.loads(lab.ssh("spark1", f"cat {gw.DIR}/{gw.VIEW_DIR}/{gw.VIEW_FILE}"))
    ev = [e for e in view["events"] if e["deployment"] == "od" and e["time"] >= sent - 1]
    act = next(e["time"] for e in ev if e["kind"] == "activate")
    serving = next(e["time"] for e in ev if e["kind"] == "serving")
    starts = [json.loads(x) for x in lab.ssh("spark1", "grep -F on-demand-start /var/lib/sparkprov/guard/events.jsonl")
              .splitlines()]
    started = next(x["epoch"] for x in reversed(starts) if x["epoch"] >= act - 1)
    return {"to_the_hook_s": round(act - sent, 2), "guard_start_s": round(started - act, 2),
            "start_to_token_s": round(serving - started, 2), "token_to_answer_s": round(answered - serving, 2)}


def until_token(start, base: str, model: str, key: str, every: float = 0.2, bound: float = BOUND_S) -> float:
    """Seconds from `start()` (a bare start) until the engine answers one token."""
    t0 = time.monotonic()
    start()
    while time.monotonic() - t0 < bound:
        if one_token(base, model, key, timeout=10):
            return time.monotonic() - t0
        time.sleep(every)
    sys.exit(f"{model} did not answer within {bound}s of its bare start")


def parked_by_the_hook(lab: Lab) -> float:
    """Wait for the hook's idle stop of od (idle_stop_s, a sweep every 10 s)."""
    t0 = time.monotonic()
    while lab.state("spark1", "sparkprov-od") == "running":
        if time.monotonic() - t0 > IDLE_STOP_S + 60:
            sys.exit("the hook did not stop od when idle")
        time.sleep(1)
    return time.monotonic() - t0


def setup(work: Path) -> dict:
    from sparklab import state, up as labup
    from sparklab.image import VLLM_CPU_IMAGE, ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT
    from sparkprov.serving import gateway as gw

    lab_down()                   # a fresh lab: nothing of an earlier run's (its guards, its containers)
    labup.up(2, images=False, quiet=True)
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [VLLM_CPU_IMAGE, gw.IMAGE])
    inv = work / "inventory.yaml"
    # the lab's inventory (sparklab/up.py) with the on-demand budget: lab-tiny reserves the planner's
    # 0.9 of a Spark's 119.6 GiB (the lab's hosts are no Sparks)
    doc = yaml.safe_load(state.inventory_path().read_text())
    doc["vars"]["ondemand_budget_gib"] = 200
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    (work / "serve-od.yaml").write_text(PLAYBOOK)
    cli(inv, "provision")
    cli(inv, "stage-weights", MODEL)
    cli(inv, "cluster-up", "--playbook", str(work / "serve-od.yaml"))
    took, g = cli(inv, "gateway", "up", "--host", "spark1", timeout=600)
    lab = Lab()
    master = lab.ssh("spark1", f"cat {gw.DIR}/{gw.MASTER_KEY}").strip()
    conf = json.loads(lab.ssh("spark1", f"cat {gw.DIR}/{gw.ONDEMAND_CONFIG}"))
    od_key = next(d["api_key"] for d in conf["deployments"] if d["name"] == "od")
    # the proxy's first request (LiteLLM's own first-call setup) and od's first start, and a first
    # cluster-up of cu (the image pulled onto spark2), in no figure
    first = first_token_through(g["gateway"]["endpoint"], OD_MODEL, master)
    cli(inv, "cluster-up", "--model", MODEL, "--hosts", "spark2", "--name", "cu", "--health-timeout", "300")
    cli(inv, "cluster-down", "--deployments", "cu")
    return {"first_request_after_gateway_up_s": round(first, 2), "inv": inv, "lab": lab, "endpoint": g["gateway"]["endpoint"], "master": master, "od_key": od_key,
            "gateway_up_s": round(took, 1)}


def recipe_argv(inv: Path) -> list[str]:
    p = subprocess.run([INVOKE, "recipe", "--alias", MODEL, "--host", "spark2", "--inventory", str(inv), "--argv"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        sys.exit(f"invoke recipe: {p.stderr[-1000:]}")
    return json.loads(p.stdout)


def one_round(env: dict, argv: list[str]) -> dict:
    lab, inv, ep = env["lab"], env["inv"], env["endpoint"]
    od_base = f"http://{lab.addr['spark1']}:8001/v1"
    parked_by_the_hook(lab)
    activation = first_token_through(ep, OD_MODEL, env["master"])
    sent, answered = LAST["sent"], LAST["answered"]
    warm = first_token_through(ep, OD_MODEL, env["master"])
    parked_by_the_hook(lab)
    split = phases(lab, sent, answered)     # the view is written at each sweep: the stop's is after both
    bare_start = until_token(lambda: lab.ssh("spark1", "docker start sparkprov-od"), od_base, OD_MODEL, env["od_key"])
    lab.ssh("spark1", "docker stop sparkprov-od")     # parked, as the hook holds it

    cu, doc = cli(inv, "cluster-up", "--model", MODEL, "--hosts", "spark2", "--name", "cu", "--health-timeout", "300")
    d = doc["cluster"]["deployments"]["cu"]
    ran = lab.ssh("spark2", "docker inspect --format '{{.Config.Image}}' sparkprov-cu").strip()
    host, path = d["api_key_file"].split(":", 1)
    key = lab.ssh(host, f"cat {path}").strip()
    cli(inv, "cluster-down", "--deployments", "cu")
    name = argv[argv.index("--name") + 1]
    port = d["endpoint"].rsplit(":", 1)[1].split("/")[0]
    bare_run = until_token(lambda: lab.ssh("spark2", shlex.join(argv)), f"http://{lab.addr['spark2']}:{port}/v1",
                           d["model"], key)
    lab.ssh("spark2", f"docker rm -f {name}")
    return {"activation_s": round(activation, 2), "warm_s": round(warm, 2), "bare_start_s": round(bare_start, 2),
            "activation_overhead_s": round(activation - bare_start, 2), "cluster_up_s": round(cu, 2),
            "bare_run_s": round(bare_run, 2), "cluster_up_overhead_s": round(cu - bare_run, 2),
            "image_cluster_up_ran": ran, "activation_phases": split}


def stamped_cluster_up(inv: Path) -> dict:
    """One cluster-up of cu in-process: each play's start and each host's result, seconds from the
    start (where cluster-up's time goes); then cluster-down."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.plays import cluster as plays
    from sparkprov.plays.options import UpOptions

    loaded = load_inventory(inv)
    o = UpOptions(model=MODEL, hosts="spark2", name="cu", health_timeout=300, json=True)
    report = stamped_report()
    deps = plays.up_deployments(loaded, o, "")
    plays.cluster_up(loaded, deps, o, plays.up_targets(loaded, deps, None), report)
    took = time.monotonic() - report.t0
    cli(inv, "cluster-down", "--deployments", "cu")
    return {"seconds": round(took, 2), "events": report.events}


def main() -> None:
    a = lab_bench_args(__doc__, "ondemand")
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="bench-ondemand-"))
    t0 = time.monotonic()
    try:
        env = setup(work)
        print(f"lab up, provisioned, od parked, gateway up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        argv = recipe_argv(env["inv"])
        rows = []
        for k in range(a.runs):
            rows.append(one_round(env, argv))
            print(f"run {k + 1}: {rows[-1]}", file=sys.stderr)
        stamped = stamped_cluster_up(env["inv"])
        print("\n".join(stamped["events"]), file=sys.stderr)
        keys = ("activation_s", "warm_s", "bare_start_s", "activation_overhead_s", "cluster_up_s", "bare_run_s",
                "cluster_up_overhead_s")
        out = {"date": date.today().isoformat(), "machine": machine(), "model": MODEL, "runs": rows,
               "medians": {k: round(median([r[k] for r in rows]), 2) for k in keys}, "recipe_argv": argv,
               "gateway_up_s": env["gateway_up_s"], "stamped_cluster_up": stamped,
               "first_request_after_gateway_up_s": env["first_request_after_gateway_up_s"]}
        print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
        if a.json:
            write_result("ondemand", out)
    finally:
        if not a.keep:
            subprocess.run([INVOKE, "gateway", "down", "--inventory", str(work / "inventory.yaml")], cwd=REPO,
                           capture_output=True, timeout=300)
            lab_down()


if __name__ == "__main__":
    main()
