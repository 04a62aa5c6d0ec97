"""cluster-up / cluster-down / status against the two-host lab.

The lab hub (lab.up serves every catalog repo, generated small with the catalog's config.json
values, gated ones behind the lab token) supplies the checkpoints; provision, then stage-weights
put them into a store of this test's own (~/clustertest) on both hosts. Then: a TP=2 Ray cluster of the catalog's
two-node recipe serves, checked by a request from here; a re-run changes nothing at one remote
call per host; cluster-down removes exactly sparkprov's containers; two different models serve on
two hosts; a worker with a wrong fabric address and a host without weights fail with the host
and the cause, leaving nothing running. One Ray TP 2 deployment, `tp`, is shared by the tests from
the README's path to the changed recipe (a Ray start is most of a minute on two cores): its bench,
its internals closed to all but its members (tests/lab/lockdown.py), a power cycle, a lost rank.
"""
# Engine: the stand-in (sparklab/engine): the catalog's Spark recipes need GPU kernels and checkpoints the CPU build cannot serve; native multi-node and recovery on the real vLLM are in test_real_tp2.py.

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from sparkprov.catalog.load import load_catalog
from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report
from tests.lab import lockdown

REPO_ROOT = Path(__file__).resolve().parents[2]
STORE = "~/clustertest"
TP_MODEL = "llama-3.3-70b"
SINGLE = ("qwen3.6-35b-a3b-mtp", "qwen3.6-27b")
FOREIGN = "not-sparkprov"


@pytest.fixture(scope="module")
def hub(lab):
    """The lab hub as lab.up runs it (not restarted: it already serves every catalog repo)."""
    from types import SimpleNamespace

    from sparklab.hub import ensure_lab_hub, hub_status, lab_token
    from sparklab.state import BRIDGE_IP, HUB_PORT

    pid = (hub_status(lab.state_dir) or {}).get("pid")
    url = ensure_lab_hub(lab.state_dir, BRIDGE_IP, HUB_PORT)
    assert pid is None or hub_status(lab.state_dir)["pid"] == pid, "lab.up left a hub without the catalog repos"
    return SimpleNamespace(url=url, token=lab_token(lab.state_dir))


@pytest.fixture(scope="module")
def env(lab, hub, tmp_path_factory):
    from sparklab.state import lab_inventory

    d = tmp_path_factory.mktemp("cluster")
    inv = d / "inventory.yaml"
    inv.write_text(lab_inventory(lab.hosts, defaults={"ssh_key": lab.key, "known_hosts": lab.known_hosts,
                                                      "become_password_file": lab.password_file},
                                 vars={"model_store": STORE, "hf_endpoint": hub.url}))
    (d / "cluster.yaml").write_text(yaml.safe_dump(
        {"deployments": [{"name": "tp", "model": TP_MODEL, "hosts": ["spark1", "spark2"], "tp": 2}]}))
    (d / "serve.yaml").write_text(yaml.safe_dump(
        {"deployments": [{"name": "one", "model": SINGLE[0], "hosts": "spark1"},
                         {"name": "two", "model": SINGLE[1], "hosts": "spark2"}]}))
    from sparkprov.cli.common import run_playbook
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}")  # the lab fixture brings the lab up without them
    from tests.lab.conftest import rails_and_guard_for_provision

    rails_and_guard_for_provision(lab)  # the modules before this one left them as they tested them
    assert run_playbook(playbook=str(REPO_ROOT / "playbooks" / "provision.yaml"), inventory=str(inv),
                        hosts=None, as_json=True) == 0
    for n in lab.names:
        lab.ssh(n, f"docker rm -f {FOREIGN} >/dev/null 2>&1; rm -rf {STORE}")
    from sparkprov.plays.stage import StageOptions, run_stage

    loaded = load_inventory(inv)
    saved = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = hub.token  # for staging the gated repos only; restored below
    try:
        for alias in (TP_MODEL,) + SINGLE:
            rep = Report(io.StringIO())
            run_stage(loaded, list(loaded.hosts), alias, StageOptions(), rep)
            assert rep.exit_code() == 0, [r.msg for r in rep.results if r.status == "failed"]
    finally:
        if saved is None:
            os.environ.pop("HF_TOKEN", None)
        else:
            os.environ["HF_TOKEN"] = saved
    yield {"inv": inv, "dir": d, "lab": lab, "token": hub.token}
    subprocess.run([INVOKE, "cluster-down", "--inventory", str(inv)], cwd=REPO_ROOT, capture_output=True, timeout=300)
    for n in lab.names:
        lab.ssh(n, f"docker rm -f {FOREIGN} >/dev/null 2>&1; rm -rf {STORE}")


INVOKE = str(REPO_ROOT / ".venv" / "bin" / "invoke")


@pytest.fixture(autouse=True)
def nothing_left_running(request):
    """A test that fails half-way leaves nothing for the next one: what sparkprov started (the
    gateway too) is removed after every test of this module that found it still there. Except a
    passing test marked keeps_serving(NAME, ...): it leaves those deployments for the tests after it
    (the Ray tp 2 deployment `tp`, shared: a Ray start is most of a minute on two cores)."""
    yield
    if "env" not in request.fixturenames:
        return
    env = request.getfixturevalue("env")
    rep = getattr(request.node, "rep_call", None)
    marker = request.node.get_closest_marker("keeps_serving")
    if marker is not None and rep is not None and not rep.failed:
        keep = {f"sparkprov-{name}-{role}" for name in marker.args for role in ("head", "worker")}
        if all(set(containers(env["lab"], h)) <= keep for h in env["lab"].names):
            return
    if any(containers(env["lab"], h) for h in env["lab"].names):
        subprocess.run([INVOKE, "gateway", "down", "--inventory", str(env["inv"])], cwd=REPO_ROOT,
                       capture_output=True, timeout=300)
        subprocess.run([INVOKE, "cluster-down", "--inventory", str(env["inv"])], cwd=REPO_ROOT,
                       capture_output=True, timeout=300)


def cli(env, task, *args, timeout=900):
    """Run a task through the real CLI with --json; (exit code, document, stderr)."""
    argv = [INVOKE, task, "--inventory", str(env["inv"]), *args, "--json"]
    p = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {}
    return p.returncode, doc, p.stderr + p.stdout[-3000:]


def up(env, *args):
    """cluster-up through the CLI; (exit code, document, output). Default: the playbook in env."""
    if not any(a in ("--model", "--playbook") for a in args):
        args = ("--playbook", str(env["dir"] / "cluster.yaml")) + args
    return cli(env, "cluster-up", "--ray-timeout", "120", "--health-timeout", "180", *args)


def down(env, *args):
    rc, doc, out = cli(env, "cluster-down", *args)
    assert rc == 0, out
    return doc


def failed(doc, host=None):
    return [r["msg"] for r in doc.get("results", []) if r["status"] == "failed" and (host is None or r["host"] == host)]


def changed(doc):
    return [r for r in doc.get("results", []) if r["status"] == "changed"]


def host_state(lab, host):
    """What a run could change on a host, read with plain ssh: containers (with IDs and state),
    images, the store's and the key's files, Ray processes."""
    script = ("docker ps -a --format '{{.Names}} {{.ID}} {{.State}}' | sort; docker images -q | sort; "
              f"find {STORE} ~/.config/sparkprov ~/.cache/sparkprov -printf '%p %s %T@\n' 2>/dev/null | sort")
    return lab.ssh(host, script).stdout + "\n".join(ray_processes(lab, host))


def containers(lab, host, label="sparkprov.managed=1"):
    out = lab.ssh(host, f"docker ps -a --filter label={label} --format '{{{{.Names}}}}'").stdout.split()
    return sorted(out)


def ray_processes(lab, host) -> list[str]:
    """Ray daemons in this host's network namespace (containers run with --network host)."""
    return ns_processes(host, ("raylet", "gcs_server", "ray::", "ray start"))


def ns_processes(host, words) -> list[str]:
    """Processes in this host's network namespace whose command line has one of `words`."""
    ns = os.stat(f"/run/netns/{host}").st_ino
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino != ns:
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(w in cmd for w in words):
            found.append(cmd[:80])
    return found


def chat(env, summary, name):
    d = summary["deployments"][name]
    host, path = d["api_key_file"].split(":", 1)
    key = env["lab"].ssh(host, f"cat {path}").stdout.strip()
    assert len(key) >= 32
    body = json.dumps({"model": d["model"], "max_tokens": 200, "chat_template_kwargs": {"enable_thinking": False},
                       "messages": [{"role": "user", "content": "What is 21*2?"}]}).encode()
    req = urllib.request.Request(d["endpoint"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def test_wrong_worker_fabric_address_fails_naming_the_host(env):
    lab = env["lab"]
    lab.sh("spark2", "ip addr del 192.168.100.12/24 dev enp1s0f1np1; ip addr add 192.168.200.12/24 dev enp1s0f1np1")
    try:
        rc, doc, out = up(env)
    finally:
        lab.sh("spark2", "ip addr del 192.168.200.12/24 dev enp1s0f1np1; ip addr add 192.168.100.12/24 dev enp1s0f1np1")
    assert rc == 2
    assert any("192.168.200.12" in m and "rank 0's subnet" in m for m in failed(doc, "spark2")), out
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []



def test_missing_weights_fail_preflight_naming_the_host(env):
    lab = env["lab"]
    repo = "meta-llama/Llama-3.3-70B-Instruct".replace("/", "--")
    lab.ssh("spark2", f"mv {STORE}/hub/models--{repo} {STORE}/moved-away")
    try:
        rc, doc, out = up(env)
    finally:
        lab.ssh("spark2", f"mv {STORE}/moved-away {STORE}/hub/models--{repo}")
    assert rc == 2
    assert any("weights not staged" in m and "stage-weights llama-3.3-70b" in m for m in failed(doc, "spark2")), out
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []



def test_check_changes_nothing_anywhere(env):
    """--check of cluster-up with nothing started: host state read back with plain ssh is the same
    before and after, and the summary says "would". (A stopped deployment's --check of cluster-up,
    cluster-down and nccl-check: test_lost_rank_makes_status_fail.)"""
    lab = env["lab"]
    down(env)
    before = {h: host_state(lab, h) for h in lab.names}
    rc, doc, out = up(env, "--check")
    assert rc == 0, out
    assert doc["cluster"]["deployments"]["tp"]["state"] == "would start or replace"
    would = {(r["host"], r["msg"].split(" (ray-")[0]) for r in changed(doc) if r["module"] == "vllm_container"}
    assert would == {("spark1", "would: drop the page cache before the load (G15); start sparkprov-tp-head"),
                     ("spark2", "would: drop the page cache before the load (G15); start sparkprov-tp-worker")}, out
    assert {h: host_state(lab, h) for h in lab.names} == before


@pytest.mark.keeps_serving("tp")
def test_tp2_cluster_serves_and_rerun_is_a_noop(env):
    """The README's path: cluster-up --model ALIAS --tp 2 (named `tp`, no playbook: the same
    deployment as cluster.yaml's, so the tests after it share this start). A foreign container on
    spark2 is left alone (test_lost_rank_makes_status_fail removes `tp` and checks it survived).
    Leaves `tp` serving."""
    lab = env["lab"]
    lab.ssh("spark2", f"docker run -d --name {FOREIGN} --network none sparkprov/smoke:latest sleep 100000 "
                      "|| docker run -d --name not-sparkprov --entrypoint sh vllm/vllm-openai:cu130-nightly -c 'sleep 100000'")
    rc, doc, out = up(env, "--model", TP_MODEL, "--tp", "2", "--hosts", "spark1,spark2", "--name", "tp")
    assert rc == 0, out
    name = "tp"
    d = doc["cluster"]["deployments"][name]
    assert d["state"] == "started" and d["endpoint"] == "http://10.77.0.11:8000/v1", d
    assert containers(lab, "spark1") == [f"sparkprov-{name}-head"]
    assert containers(lab, "spark2") == [f"sparkprov-{name}-worker"]
    assert "42" in chat(env, doc["cluster"], name)
    logs = lab.ssh("spark1", f"docker logs sparkprov-{name}-head 2>&1").stdout
    assert "GLOO_SOCKET_IFNAME=enp1s0f1np1" in logs and "192.168.100.12" in logs, logs[-2000:]
    assert lab.ssh("spark1", "stat -c %a ~/.config/sparkprov/api_key").stdout.strip() == "600"
    inspect = lab.ssh("spark1", f"docker inspect sparkprov-{name}-head").stdout
    key = lab.ssh("spark1", "cat ~/.config/sparkprov/api_key").stdout.strip()
    assert key not in inspect
    assert "pip install" not in inspect and "pip install" not in lab.ssh("spark2", f"docker inspect sparkprov-{name}-worker").stdout

    # the same deployment from the playbook: unchanged, one remote call per host
    rc, doc2, out2 = up(env)
    assert rc == 0, out2
    assert doc2["cluster"]["deployments"][name]["state"] == "already up, unchanged"
    assert changed(doc2) == [], out2
    assert {h: t["remote_calls"] for h, t in doc2["hosts"].items()} == {"spark1": 1, "spark2": 1}, out2

    rc, st, out3 = cli(env, "status")
    assert rc == 0, out3
    head = next(c for c in st["hosts"]["spark1"]["containers"] if c["name"] == f"sparkprov-{name}-head")
    assert head["ray"]["nodes"] == 2 and head["ray"]["gpus"] == 2 and head["health"] == 200
    assert "kv_cache_usage" in head["metrics"]
    assert st["hosts"]["spark1"]["deployments"][name]["problems"] == []



@pytest.mark.keeps_serving("tp")
def test_bench_watch_and_monitor_a_tp2_deployment(env, tmp_path):
    """invoke bench at concurrency 1 and 4 over the Ray TP 2 deployment: vLLM's client in the head's
    container, the key handed over on the host; JSON and plot under the recipe hash; --compare
    against the run before; --check runs nothing and writes nothing. Then status --watch and
    invoke monitor on the same deployment. Leaves `tp` serving for the tests after it."""
    lab = env["lab"]
    rc, doc, out = up(env)
    assert rc == 0, out
    results = tmp_path / "bench"
    args = ("tp", "--concurrency", "1,4", "--input-len", "32", "--output-len", "16", "--results", str(results))
    before = {h: host_state(lab, h) for h in lab.names}
    rc, chk, out = cli(env, "bench", *args, "--check")
    assert rc == 0, out
    assert chk["bench"]["runs"] == [] and chk["bench"]["served_on"] == ["spark1"], out
    assert {h: host_state(lab, h) for h in lab.names} == before and not results.exists()

    rc, b1, out = cli(env, "bench", *args)
    assert rc == 0, out
    (run,) = b1["bench"]["runs"]
    assert run["host"] == "spark1" and [r["concurrency"] for r in run["rows"]] == [1, 4], run
    for r in run["rows"]:
        assert r["completed"] == r["num_prompts"] == max(4 * r["concurrency"], 8) and r["failed"] == 0, r
        assert r["total_output_tokens"] == 16 * r["num_prompts"] and r["total_input_tokens"] >= 32 * r["num_prompts"]
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["itl_p50_ms"] > 0 and r["output_throughput"] > 0, r
    head = json.loads(lab.ssh("spark1", "docker inspect sparkprov-tp-head").stdout)[0]
    assert run["recipe_hash"] == head["Config"]["Labels"]["sparkprov.recipe_hash"] and run["image_id"] == head["Image"]
    path = Path(run["path"])
    assert path.parent == results / "tp" / run["recipe_hash"] and json.loads(path.read_text())["rows"] == run["rows"]
    assert Path(run["plot"]).read_bytes()[:4] == b"\x89PNG"
    key = lab.ssh("spark1", "cat ~/.config/sparkprov/api_key").stdout.strip()
    assert len(key) >= 32 and key not in path.read_text() and key not in out
    assert key not in lab.ssh("spark1", "docker inspect sparkprov-tp-head").stdout

    rc, b2, out = cli(env, "bench", *args, "--compare")
    assert rc == 0, out
    cmp = b2["bench"]["runs"][0]["compare"]
    assert cmp["against"] == run["path"] and cmp["same_image"] and set(cmp["levels"]) == {"1", "4"}
    assert len(list((results / "tp" / run["recipe_hash"]).glob("*.json"))) == 2

    rc, _, out = cli(env, "bench", "nosuch", "--results", str(results))
    assert rc == 2 and "no host of spark1, spark2 serves nosuch" in out, out

    # status --watch refreshes (two reads, two tables); monitor's files name this deployment, and
    # every vLLM metric its dashboard queries is one the live rank 0 exposes
    p = subprocess.run([INVOKE, "status", "--inventory", str(env["inv"]), "--watch", "0.5", "--count", "2"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.count("refreshed ") == 2 and p.stdout.count("tp (rank 0 on spark1): 2/2 nodes") == 2, p.stdout
    mon = tmp_path / "monitoring"
    p = subprocess.run([INVOKE, "monitor", "write", "--inventory", str(env["inv"]), "--out", str(mon)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    targets = json.loads((mon / "targets" / "vllm.json").read_text())
    assert [(t["targets"], t["labels"]["deployment"]) for t in targets] == [(["10.77.0.11:8000"], "tp")], targets
    req = urllib.request.Request("http://10.77.0.11:8000/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as r:
        live = {line.split("{")[0].split(" ")[0] for line in r.read().decode().splitlines() if line.startswith("vllm:")}
    # the queries' vLLM names (the unit suite checks every name against /metrics with speculative
    # decoding on; this deployment has none, and vLLM shows spec_decode_* only when it has)
    exprs = [t["expr"] for panel in json.loads((mon / "grafana-dashboard.json").read_text())["panels"]
             for t in panel.get("targets", [])]
    queried = {n for e in exprs for n in re.findall(r"vllm:[A-Za-z0-9_:]*[A-Za-z0-9_]", e)}
    assert queried and {n for n in queried if not n.startswith("vllm:spec_decode")} <= live, queried - live



@pytest.mark.keeps_serving("tp")
def test_ray_tp2_internals_are_closed_and_need_the_token(env):
    """Serving internals let no one in (issue 27), on the Ray TP 2 deployment `tp` (the stand-in engine:
    the real vLLM's CPU build refuses Ray; Ray itself is the real Ray 2.60.0 of the lab's Ray image;
    started if the test before left none): every socket either member listens on is reachable only as
    `status --ports` says (tests/lab/lockdown.py), and that command exits 0. A Ray driver without the
    token, or with a wrong one, is refused even from a member's fabric address; with the right one
    (inside the worker's container) it joins; the token is in no argv, `docker inspect` output or
    container log. A port opened on purpose to everyone is reported and `status --ports` exits 2.
    Leaves `tp` serving."""
    from sparklab.prebuild import RAY_VENV, ensure_ray_venv

    lab = env["lab"]
    ensure_ray_venv()  # the driver that knocks without the token: the lab's Ray 2.60.0
    rc, doc, out = up(env)
    assert rc == 0, out
    assert "42" in chat(env, doc["cluster"], "tp")
    lockdown.assert_locked(lab, env["inv"], "tp", 8000)

    path = "~/.config/sparkprov/deployments/tp/ray_token"
    token = lab.ssh("spark1", f"cat {path}").stdout.strip()
    assert len(token) == 64 and lab.ssh("spark2", f"cat {path}").stdout.strip() == token
    assert {lab.ssh(h, f"stat -c %a {path}").stdout.strip() for h in lab.names} == {"600"}
    driver = ("import ray, sys\ntry:\n  ray.init(address=sys.argv[1], log_to_driver=False)\n"
              "  print('JOINED', ray.cluster_resources().get('GPU'))\nexcept Exception as e:\n"
              "  print('REFUSED', type(e).__name__, str(e)[:300])")
    head = f"{lockdown.FABRIC['spark1']}:6379"
    for token_env in ({}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}):
        run_env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "RAY_DISABLE_USAGE_STATS": "1", **token_env}
        r = lab.exec("spark2", ["env", *(f"{k}={v}" for k, v in run_env.items()), str(RAY_VENV / "bin" / "python"),
                                "-c", driver, head], check=False, timeout=180)
        said = r.stdout + r.stderr
        assert "REFUSED" in said and "uthenticat" in said, said[-2000:]
    # with the token (the worker container's mounted file) a driver joins: the refusals were the token's
    said = lab.exec("spark2", ["docker", "exec", "sparkprov-tp-worker", "python3", "-c", driver, head],
                    check=False, timeout=180)
    assert "JOINED 2.0" in said.stdout, (said.stdout + said.stderr)[-2000:]
    for host, name in (("spark1", "sparkprov-tp-head"), ("spark2", "sparkprov-tp-worker")):
        seen = lab.ssh(host, f"docker inspect {name}; docker logs {name} 2>&1").stdout
        assert "RAY_AUTH_TOKEN_PATH=/run/sparkprov/ray_token" in seen and token not in seen
    argvs = [Path(f"/proc/{p}/cmdline").read_bytes() for p in os.listdir("/proc") if p.isdigit()
             and os.path.exists(f"/proc/{p}/cmdline")]
    assert not any(token.encode() in a for a in argvs)

    # a port opened on purpose to everyone: reported and status fails
    opened = lab.sh("spark1", "nohup python3 -m http.server 8765 --bind 0.0.0.0 >/dev/null 2>&1 & echo $!").stdout
    try:
        lab.sh("spark1", "for i in $(seq 50); do ss -H -tln | grep -q :8765 && break; sleep 0.1; done")
        rc, doc, out = cli(env, "status", "--ports")
        assert rc == 2, out
        assert [r["port"] for r in doc["hosts"]["spark1"]["ports"] if r["flag"]] == [8765], out
    finally:
        lab.sh("spark1", f"kill {opened.strip()}")



def _down_within(endpoint, key, bound):
    """Seconds until /health stops answering 200 (None: it kept answering). A rank lost makes the
    engine die, as vLLM does, but not at once: until then the old engine still answers."""
    import time

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        try:
            req = urllib.request.Request(endpoint.rsplit("/v1", 1)[0] + "/health", headers={"Authorization": f"Bearer {key}"})
            with opener.open(req, timeout=5) as r:
                if r.status != 200:
                    return time.monotonic() - t0
        except (OSError, ValueError):
            return time.monotonic() - t0
        time.sleep(1)
    return None



def _smoke_until(env, endpoint, model, key, bound):
    """Ask the smoke question until the right answer comes back; seconds it took (None: never)."""
    import time

    body = json.dumps({"model": model, "max_tokens": 200, "chat_template_kwargs": {"enable_thinking": False},
                       "messages": [{"role": "user", "content": "What is 21*2?"}]}).encode()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        req = urllib.request.Request(endpoint + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with opener.open(req, timeout=20) as r:
                if "42" in json.loads(r.read())["choices"][0]["message"]["content"]:
                    return time.monotonic() - t0
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(3)
    return None



def _guard_journals(lab) -> dict[str, list[str]]:
    """The end of each node guard's journal (what it saw and did), and each node's containers with the
    end of their logs, for a failure's message."""
    look = ("tail -n 15 /var/lib/sparkprov/guard/events.jsonl 2>/dev/null; docker ps -a --format "
            "'{{.Names}} {{.Status}}'; for c in $(docker ps -aq --filter label=sparkprov.deployment=tp); do "
            "docker logs --tail 12 $c 2>&1; done; :")
    return {h: lab.exec(h, ["sh", "-c", look], check=False).stdout.splitlines()[-60:] for h in lab.names}


# (each node in turn: tests/lab/test_real_tp2.py reboots rank 0's node, then rank 1's, of a native
# deployment on the real vLLM)
@pytest.mark.keeps_serving("tp")
def test_power_cycle_of_each_node_comes_back_by_itself(env):
    """Both nodes of a Ray TP 2 deployment lose power at once (the desk's power strip: every
    process killed, live network reset, each booted from what is persisted, the two boots seconds
    apart, whichever first); with no sparkprov command in between, the deployment goes down, status
    exits 2, and it answers the smoke question again within the bound (the head waits for its worker,
    the worker retries its head), with status healthy after. The shared deployment `tp` (started if
    the test before left none): one Ray start for both nodes, a Ray start is a minute here. Leaves
    it serving."""
    import time

    lab = env["lab"]
    rc, doc, out = up(env)
    assert rc == 0, out
    d = doc["cluster"]["deployments"]["tp"]
    host, path = d["api_key_file"].split(":", 1)
    key = lab.ssh(host, f"cat {path}").stdout.strip()
    t0 = time.monotonic()
    cycles = [subprocess.Popen([INVOKE, "lab.fault", "reboot", victim], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for victim in ("spark2", "spark1")]
    for p in cycles:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    booted = time.monotonic() - t0
    # the deployment is down (both nodes' processes are gone), then comes back by itself
    died = _down_within(d["endpoint"], key, bound=180)
    assert died is not None, "the Ray engine kept answering with both nodes rebooted"
    rc, st, out = cli(env, "status")
    assert rc == 2, f"status exited {rc} while the deployment was down after both nodes rebooted: {out}"
    secs = _smoke_until(env, d["endpoint"], d["model"], key, bound=480)
    print(f"\n[recovery] ray, both nodes power-cycled: boots {booted:.1f}s, down {died:.1f}s after, "
          f"answering again {secs}s after that; status while down exited 2")
    assert secs is not None, ("the Ray deployment did not come back within 480 s after both nodes rebooted; "
                              f"the guards' journals: {_guard_journals(lab)}")
    rc, st, out = cli(env, "status")
    assert rc == 0, out



def test_lost_rank_makes_status_fail(env):
    """A Ray TP 2 deployment whose worker container is killed (the shared `tp`, started if the test
    before left none): status says degraded, exit 2. Then both its containers stopped (not removed):
    --check of cluster-up, cluster-down and nccl-check change nothing (host state read back with plain ssh) and
    say what they would do on each host. cluster-down removes exactly sparkprov's containers (the
    foreign one of test_tp2_cluster_serves_and_rerun_is_a_noop stays), no Ray process, no rule."""
    lab = env["lab"]
    rc, doc, out = up(env)
    assert rc == 0, out
    lab.ssh("spark2", "docker kill sparkprov-tp-worker")
    rc, st, out = cli(env, "status")
    assert rc == 2, out
    problems = st["hosts"]["spark1"]["deployments"]["tp"]["problems"]
    assert any("sparkprov-tp-worker on spark2 is exited" in p for p in problems), problems

    for h in lab.names:
        lab.ssh(h, "docker stop -t 5 $(docker ps -q --filter label=sparkprov.managed=1) >/dev/null 2>&1; true")
    stopped = {h: host_state(lab, h) for h in lab.names}
    rc, doc, out = up(env, "--check")
    assert rc == 0, out
    assert {r["host"] for r in changed(doc) if r["msg"].startswith("would: ")} == set(lab.names), out
    rc, doc, out = cli(env, "cluster-down", "--check")
    assert rc == 0 and {r["host"] for r in changed(doc)} == set(lab.names), out
    rc, doc, out = cli(env, "nccl-check", "--hosts", "spark1,spark2", "--backend", "gloo", "--check",
                       "--playbook", str(env["dir"] / "cluster.yaml"))
    assert rc == 0, out
    assert {h: host_state(lab, h) for h in lab.names} == stopped

    doc = down(env)
    assert sorted(doc["removed"]["spark1"] + doc["removed"]["spark2"]) == ["sparkprov-tp-head", "sparkprov-tp-worker"]
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []
    # (the power cycle stopped it: it has no restart policy)
    assert FOREIGN in lab.ssh("spark2", "docker ps -a --format '{{.Names}}'").stdout.split()
    assert ray_processes(lab, "spark1") == [] and ray_processes(lab, "spark2") == []
    lockdown.assert_no_rule_left(lab)  # cluster-down leaves no sparkprov table and no rule file



@pytest.mark.keeps_serving("tp")
def test_stage_in_the_same_run_and_its_check_changes_nothing(env):
    """cluster-up --stage on a host that lacks the weights: --check downloads, copies and starts
    nothing (state read back with plain ssh) and says what it would do; then the real run stages
    and serves. Leaves `tp` serving (for the changed recipe next)."""
    lab = env["lab"]
    down(env)
    repo = "meta-llama/Llama-3.3-70B-Instruct".replace("/", "--")
    lab.ssh("spark2", f"rm -rf {STORE}/hub/models--{repo}")
    before = {h: host_state(lab, h) for h in lab.names}
    saved = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = env["token"]
    try:
        rc, doc, out = up(env, "--check", "--stage")
        assert rc == 0, out
        assert {h: host_state(lab, h) for h in lab.names} == before
        msgs = " | ".join(r["msg"] for r in changed(doc))
        assert "would: send" in msgs and "to spark2" in msgs and "would: drop the page cache" in msgs, msgs
        assert doc["cluster"]["deployments"]["tp"]["state"] == "would start or replace"
        rc, doc, out = up(env, "--stage")
        assert rc == 0, out
        assert "42" in chat(env, doc["cluster"], "tp")
    finally:
        if saved is None:
            os.environ.pop("HF_TOKEN", None)
        else:
            os.environ["HF_TOKEN"] = saved



def managed(lab, host) -> dict[str, tuple[str, str, str]]:
    """name -> (container ID, recipe hash label, state) of sparkprov's containers on a host."""
    out = lab.ssh(host, "docker ps -a --filter label=sparkprov.managed=1 --format "
                        "'{{.Names}} {{.ID}} {{.Label \"sparkprov.recipe_hash\"}} {{.State}}'").stdout
    return {w[0]: (w[1], w[2], w[3]) for w in (line.split() for line in out.splitlines()) if len(w) == 4}



def test_changed_recipe_replaces_the_running_containers(env):
    """A changed recipe (--max-model-len) replaces `tp`'s containers on both nodes (started if the test
    before left none); a rerun changes nothing at one remote call per host."""
    lab = env["lab"]
    rc, doc, out = up(env)
    assert rc == 0, out
    before = {h: managed(lab, h) for h in lab.names}
    assert set(before["spark1"]) == {"sparkprov-tp-head"} and set(before["spark2"]) == {"sparkprov-tp-worker"}
    (env["dir"] / "cluster-mml.yaml").write_text(yaml.safe_dump({"deployments": [
        {"name": "tp", "model": TP_MODEL, "hosts": ["spark1", "spark2"], "tp": 2,
         "overrides": {"--max-model-len": 6000}}]}))

    rc, doc2, out2 = up(env, "--playbook", str(env["dir"] / "cluster-mml.yaml"))
    assert rc == 0, out2
    assert doc2["cluster"]["deployments"]["tp"]["state"] == "started", out2
    after = {h: managed(lab, h) for h in lab.names}
    # the head's `docker run` carries the vLLM flags: a new hash, a new container; the worker names
    # the head's container, so it is replaced with it (a Ray cluster does not re-admit a lost head)
    for h in lab.names:
        assert set(after[h]) == set(before[h])
        for name, (cid, rhash, state) in after[h].items():
            assert cid != before[h][name][0] and rhash != before[h][name][1], (h, name)
    assert all(st == "running" for h in lab.names for (_, _, st) in after[h].values())
    assert "--max-model-len 6000" in lab.ssh("spark1", "docker inspect --format '{{join .Args \" \"}}' "
                                                       "sparkprov-tp-head").stdout.replace("=", " ")
    assert "42" in chat(env, doc2["cluster"], "tp")

    rc, doc3, out3 = up(env, "--playbook", str(env["dir"] / "cluster-mml.yaml"))
    assert rc == 0, out3
    assert doc3["cluster"]["deployments"]["tp"]["state"] == "already up, unchanged"
    assert changed(doc3) == [], out3
    assert all(t["remote_calls"] == 1 for t in doc3["hosts"].values()), doc3["hosts"]
    assert {h: managed(lab, h) for h in lab.names} == after
    down(env)
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []



def test_two_models_on_two_hosts_and_one_gateway_in_front(env):
    """Two models on two hosts; then `invoke gateway up` (LiteLLM's proxy, the lab's build of it)
    reaches each by model name with its own key; cluster-down of one takes its route away; gateway
    down removes the proxy and the file holding the servers' keys."""
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT
    from sparkprov.serving import gateway as gw

    lab = env["lab"]
    rc, doc, out = up(env, "--playbook", str(env["dir"] / "serve.yaml"), "--tp", "1")
    assert rc == 0, out
    assert containers(lab, "spark1") == ["sparkprov-one"] and containers(lab, "spark2") == ["sparkprov-two"]
    deps = doc["cluster"]["deployments"]
    assert "42" in chat(env, doc["cluster"], "one") and "42" in chat(env, doc["cluster"], "two")
    assert deps["one"]["model"] != deps["two"]["model"]

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [gw.IMAGE])
    before = {h: host_state(lab, h) for h in lab.names}
    rc, chk, out = cli(env, "gateway", "up", "--check")
    assert rc == 0, out
    assert {h: host_state(lab, h) for h in lab.names} == before
    rc, g, out = cli(env, "gateway", "up", timeout=600)
    assert rc == 0, out
    assert g["gateway"]["endpoint"] == "http://10.77.0.11:4000/v1" and g["gateway"]["host"] == "spark1", g
    assert sorted(g["gateway"]["models"]) == sorted([deps["one"]["model"], deps["two"]["model"]])
    master = lab.ssh("spark1", f"cat {gw.DIR}/{gw.MASTER_KEY}").stdout.strip()
    assert master.startswith("sk-")
    for name in ("one", "two"):
        assert "42" in gateway_chat(g["gateway"]["endpoint"], master, deps[name]["model"])
    with pytest.raises(urllib.error.HTTPError):
        gateway_chat(g["gateway"]["endpoint"], "sk-wrong", deps["one"]["model"])
    inspect = lab.ssh("spark1", f"docker inspect {gw.CONTAINER}").stdout
    server_keys = [lab.ssh(h, "cat ~/.config/sparkprov/api_key").stdout.strip() for h in ("spark1", "spark2")]
    assert all(k and k not in inspect and k not in out for k in server_keys + [master])
    assert lab.ssh("spark1", f"stat -c %a {gw.DIR}/{gw.CONFIG} {gw.DIR}/{gw.MASTER_KEY}").stdout.split() == ["600", "600"]
    rc, again, out = cli(env, "gateway", "up")
    assert rc == 0 and changed(again) == [], out

    # cluster-down of one deployment: the gateway no longer routes to it, the other still answers
    rc, d, out = cli(env, "cluster-down", "--deployments", "two")
    assert rc == 0 and "routes updated" in (d.get("gateway") or ""), out
    assert "42" in gateway_chat(g["gateway"]["endpoint"], master, deps["one"]["model"])
    with pytest.raises(urllib.error.HTTPError):
        gateway_chat(g["gateway"]["endpoint"], master, deps["two"]["model"])
    assert containers(lab, "spark1") == sorted(["sparkprov-one", gw.CONTAINER])  # cluster-down leaves the gateway

    rc, gd, out = cli(env, "gateway", "down")
    assert rc == 0, out
    assert containers(lab, "spark1") == ["sparkprov-one"]
    assert lab.ssh("spark1", f"ls {gw.DIR}").stdout.split() == [gw.MASTER_KEY]  # the servers' keys went with it
    down(env)
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []



def gateway_chat(endpoint, key, model):
    body = json.dumps({"model": model, "max_tokens": 200, "chat_template_kwargs": {"enable_thinking": False},
                       "messages": [{"role": "user", "content": "What is 21*2?"}]}).encode()
    req = urllib.request.Request(endpoint + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]



def test_ulimit_memlock_unlimited_container_starts(env):
    """Recipes (qwen3.6-35b-a3b-ngc, gemma-4-26b-a4b-fp8-mtp) run with --ulimit memlock=-1."""
    from sparklab import dockerd

    lab = env["lab"]
    exited = "docker ps -aq --filter ancestor=sparkprov/smoke:latest --filter status=exited"
    for h in lab.names:
        before = set(lab.ssh(h, exited).stdout.split())
        r = lab.ssh(h, "docker run --rm --network none --ulimit memlock=-1 --ulimit stack=67108864 "
                       "sparkprov/smoke:latest sh -c 'ulimit -l; ulimit -s'")
        assert r.returncode == 0, (h, r.stderr)
        locked, stack = r.stdout.split()
        assert stack == "65536"
        if dockerd.can_raise_memlock():
            assert locked == "unlimited"
        else:  # root here may not raise hard limits: the lab's runtime capped it at dockerd's, and says so
            assert locked.isdigit()
            assert "RLIMIT_MEMLOCK" in lab.sh(h, f"cat {dockerd.RLIMIT_LOG}").stdout
        # its own --rm run leaves nothing (an exited smoke container of an earlier test is that test's:
        # seen after the power cycles, cause not found yet, named in the issue notes)
        assert set(lab.ssh(h, exited).stdout.split()) <= before



def test_nccl_check_over_the_fabric(env):
    """nccl-check (the CLI) runs the all-reduce with Gloo on CPU in the serving image (torch layer)."""
    import subprocess
    import time

    from sparklab import image
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    lab = env["lab"]
    base = image.ensure_base()
    wheel, why = image.find_torch_wheel(base.python)
    cat = load_catalog()
    r = cat.get(TP_MODEL)
    name = cat.image(r.image).pinned if cat.image(r.image) else r.image
    t0 = time.monotonic()
    image.ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [name])
    pushed = time.monotonic() - t0
    pulls = {}
    for h in lab.names:
        t0 = time.monotonic()
        res = lab.ssh(h, f"docker pull -q {name}")
        pulls[h] = round(time.monotonic() - t0, 1)
        assert res.returncode == 0, res.stderr
    print(f"\n[timing] build+push {name}: {pushed:.1f}s; docker pull per host: {pulls}")

    def nccl(threshold, backend="gloo"):
        argv = [INVOKE, "nccl-check", "--hosts", "spark1,spark2", "--backend", backend,
                "--inventory", str(env["inv"]), "--playbook", str(env["dir"] / "cluster.yaml"),
                "--max-bytes", "64M", "--iters", "5", "--threshold", str(threshold), "--json"]
        t0 = time.monotonic()
        p = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        return p, time.monotonic() - t0

    # NCCL is the default: the lab's containers have no GPU, so it fails naming the host and the fix
    p, _ = nccl(0.001, backend="nccl")
    assert p.returncode == 2, p.stdout[-3000:]
    msgs = [x["msg"] for x in json.loads(p.stdout)["results"] if x["status"] == "failed"]
    assert any("spark1" in m and "cannot see the GPU" in m and "--backend gloo" in m for m in msgs), msgs

    # the lab measures its fabric with Gloo on the CPU, asked for explicitly
    p, secs = nccl(0.001)
    if wheel is None:
        assert p.returncode == 2
        doc = json.loads(p.stdout)
        msg = next(x["msg"] for x in doc["results"] if x["status"] == "failed")
        assert "has no torch" in msg and "\n" not in msg
        pytest.skip(f"no torch wheel on this machine ({why}): checked the one-line failure")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(p.stdout)["nccl"]["result"]
    print(f"[nccl-check] {secs:.1f}s: backend {res['backend']}, busbw {res['busbw_gbs']:.3f} GB/s, "
          f"peak {res['peak_busbw_gbs']:.3f} GB/s, {res['ranks']}")
    assert res["backend"] == "gloo" and res["busbw_gbs"] > 0 and res["pass"]
    assert {(r["ifname"], r.get("address")) for r in res["ranks"]} == {("enp1s0f1np1", "192.168.100.11"),
                                                                      ("enp1s0f1np1", "192.168.100.12")}

    # below the threshold is a failure, with Gloo too (no "reported, not failed")
    p, _ = nccl(5000)
    assert p.returncode == 2, p.stdout[-3000:]
    full = json.loads(p.stdout)
    assert any("below the threshold" in x["msg"] for x in full["results"] if x["host"] == "spark1")
    for h in lab.names:  # nothing left running
        assert lab.ssh(h, "docker ps -aq --filter name=sparkprov-nccl-check").stdout == ""
        assert ns_processes(h, ("torch.distributed.run", "allreduce_bench")) == []
