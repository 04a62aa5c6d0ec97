"""cluster-up / cluster-down / status against the two-host lab.

A hub of our own on the lab bridge serves small generated checkpoints under the catalog's repo
names (with the catalog's config.json values); provision, then stage-weights put them into a
store of this test's own (~/clustertest) on both hosts. Then: a TP=2 Ray cluster of the catalog's
two-node recipe serves, checked by a request from here; a re-run changes nothing at one remote
call per host; cluster-down removes exactly sparkprov's containers; two different models serve on
two hosts; a worker with a wrong fabric address and a host without weights fail with the host
and the cause, leaving nothing running.
"""

from __future__ import annotations

import io
import json
import os
import urllib.request
from pathlib import Path

import pytest

from sparkprov.catalog.load import load_catalog
from sparkprov.cluster.bringup import UpOptions, cluster_up
from sparkprov.cluster.manage import down, status
from sparkprov.cluster.playbook import load_serve_playbook, select
from sparkprov.data.inventory import load_inventory
from sparkprov.engine.report import Report

REPO_ROOT = Path(__file__).resolve().parents[2]
HUB_IP = "10.77.0.1"
STORE = "~/clustertest"
TP_MODEL = "llama-3.3-70b"
SINGLE = ("qwen3.6-35b-a3b-mtp", "qwen3.6-27b")
FOREIGN = "not-sparkprov"
TOKEN = "hf_sparkprovLabClusterToken" + "q8Zr2Lm5Xv7Nb3Kc9Wd4Tp6Hy1"


@pytest.fixture(scope="module")
def hub():
    from sparkprov.lab.hub import RepoSpec, ensure_generated, start_in_thread

    root = Path(os.environ.get("SPARKPROV_LAB_CACHE", REPO_ROOT / ".lab-cache")) / "hub"
    wanted = (TP_MODEL,) + SINGLE
    specs = [RepoSpec(info.repo, num_shards=2, total_size=4 << 20, config=info.config or {})
             for info in load_catalog().repos() if set(info.used_by) & set(wanted)]
    server = start_in_thread([ensure_generated(s, root) for s in specs], bind=HUB_IP, port=0, token=TOKEN)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def env(lab, hub, tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    inv = d / "inventory.yaml"
    inv.write_text(
        "defaults:\n  user: nvidia\n"
        f"  ssh_key: {lab.key}\n  known_hosts: {lab.known_hosts}\n  become_password_file: {lab.password_file}\n"
        "hosts:\n" + "".join(f"  {n}: {{address: {a}}}\n" for n, a in lab.hosts.items())
        + f"groups:\n  sparks: [{', '.join(lab.names)}]\n"
        f"vars:\n  model_store: {STORE}\n  hf_endpoint: {hub.url}\n")
    (d / "cluster.yaml").write_text(f"deployments:\n  - {{name: tp, model: {TP_MODEL}, hosts: [spark1, spark2], tp: 2}}\n")
    (d / "serve.yaml").write_text("deployments:\n"
                                  f"  - {{name: one, model: {SINGLE[0]}, hosts: spark1}}\n"
                                  f"  - {{name: two, model: {SINGLE[1]}, hosts: spark2}}\n")
    from sparkprov.cli.common import run_playbook

    assert run_playbook(playbook=str(REPO_ROOT / "playbooks" / "provision.yaml"), inventory=str(inv),
                        hosts=None, as_json=True) == 0
    for n in lab.names:
        lab.ssh(n, f"docker rm -f {FOREIGN} >/dev/null 2>&1; rm -rf {STORE}")
    os.environ["HF_TOKEN"] = TOKEN
    from sparkprov.staging.transfer import StageOptions, run_stage

    loaded = load_inventory(inv)
    for alias in (TP_MODEL,) + SINGLE:
        rep = Report(io.StringIO())
        run_stage(loaded, list(loaded.hosts), alias, StageOptions(), rep)
        assert rep.exit_code() == 0, [r.msg for r in rep.results if r.status == "failed"]
    yield {"inv": inv, "dir": d, "lab": lab}
    down(load_inventory(inv), lab.names, Report(io.StringIO()))
    for n in lab.names:
        lab.ssh(n, f"docker rm -f {FOREIGN} >/dev/null 2>&1; rm -rf {STORE}")


def up(env, playbook="cluster.yaml", tp=None, **kw):
    inv = load_inventory(env["inv"])
    pb = load_serve_playbook(env["dir"] / playbook, inv)
    buf = io.StringIO()
    report = Report(buf)
    opts = UpOptions(progress_stream=buf, live=False, ray_timeout=kw.pop("ray_timeout", 120),
                     health_timeout=kw.pop("health_timeout", 180), **kw)
    summary = cluster_up(inv, pb, select(pb, tp=tp, hosts=None, names=None), opts, report)
    return report, summary, buf.getvalue()


def containers(lab, host, label="sparkprov.managed=1"):
    out = lab.ssh(host, f"docker ps -a --filter label={label} --format '{{{{.Names}}}}'").stdout.split()
    return sorted(out)


def ray_processes(lab, host) -> list[str]:
    """Ray daemons in this host's network namespace (containers run with --network host)."""
    ns = os.stat(f"/run/netns/{host}").st_ino
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino != ns:
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(w in cmd for w in ("raylet", "gcs_server", "ray::", "ray start")):
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


def test_tp2_cluster_serves_and_rerun_is_a_noop(env):
    lab = env["lab"]
    lab.ssh("spark2", f"docker run -d --name {FOREIGN} --network none sparkprov/smoke:latest sleep 100000 "
                      "|| docker run -d --name not-sparkprov --entrypoint sh vllm/vllm-openai:cu130-nightly -c 'sleep 100000'")
    rep, summary, out = up(env, tp=2)
    assert rep.exit_code() == 0, out
    d = summary["deployments"]["tp"]
    assert d["action"] == "start" and d["endpoint"] == "http://10.77.0.11:8000/v1"
    assert containers(lab, "spark1") == ["sparkprov-tp-head"] and containers(lab, "spark2") == ["sparkprov-tp-worker"]
    assert "42" in chat(env, summary, "tp")
    logs = lab.ssh("spark1", "docker logs sparkprov-tp-head 2>&1").stdout
    assert "GLOO_SOCKET_IFNAME=enp1s0f1np1" in logs and "192.168.100.12" in logs, logs[-2000:]
    assert lab.ssh("spark1", "stat -c %a ~/.config/sparkprov/api_key").stdout.strip() == "600"
    inspect = lab.ssh("spark1", "docker inspect sparkprov-tp-head").stdout
    key = lab.ssh("spark1", "cat ~/.config/sparkprov/api_key").stdout.strip()
    assert key not in inspect

    rep2, summary2, out2 = up(env, tp=2)
    assert rep2.exit_code() == 0, out2
    assert summary2["deployments"]["tp"]["action"] == "ok"
    assert all(t.changed == 0 for t in rep2.hosts.values()), out2
    assert all(t.remote_calls == 1 for t in rep2.hosts.values()), {h: t.remote_calls for h, t in rep2.hosts.items()}

    st = status(load_inventory(env["inv"]), lab.names)
    head = next(c for c in st["spark1"]["containers"] if c["name"] == "sparkprov-tp-head")
    assert head["ray"]["nodes"] == 2 and head["ray"]["gpus"] == 2 and head["health"] == 200
    assert "kv_cache_usage" in head["metrics"]

    rep3 = Report(io.StringIO())
    down(load_inventory(env["inv"]), lab.names, rep3)
    assert rep3.exit_code() == 0
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []
    assert FOREIGN in lab.ssh("spark2", "docker ps --format '{{.Names}}'").stdout
    assert ray_processes(lab, "spark1") == [] and ray_processes(lab, "spark2") == []


def test_two_models_on_two_hosts(env):
    lab = env["lab"]
    rep, summary, out = up(env, "serve.yaml", tp=1)
    assert rep.exit_code() == 0, out
    assert containers(lab, "spark1") == ["sparkprov-one"] and containers(lab, "spark2") == ["sparkprov-two"]
    assert "42" in chat(env, summary, "one") and "42" in chat(env, summary, "two")
    assert summary["deployments"]["one"]["model"] != summary["deployments"]["two"]["model"]
    down(load_inventory(env["inv"]), lab.names, Report(io.StringIO()))
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []


def test_wrong_worker_fabric_address_fails_naming_the_host(env):
    lab = env["lab"]
    lab.sh("spark2", "ip addr del 192.168.100.12/24 dev enp1s0f1np1; ip addr add 192.168.200.12/24 dev enp1s0f1np1")
    try:
        rep, summary, out = up(env, tp=2)
    finally:
        lab.sh("spark2", "ip addr del 192.168.200.12/24 dev enp1s0f1np1; ip addr add 192.168.100.12/24 dev enp1s0f1np1")
    assert rep.exit_code() == 2
    failed = [r for r in rep.results if r.status == "failed"]
    assert any(r.host == "spark2" and "192.168.200.12" in r.msg and "head's subnet" in r.msg for r in failed), out
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []


def test_missing_weights_fail_preflight_naming_the_host(env):
    lab = env["lab"]
    repo = "meta-llama/Llama-3.3-70B-Instruct".replace("/", "--")
    lab.ssh("spark2", f"mv {STORE}/hub/models--{repo} {STORE}/moved-away")
    try:
        rep, summary, out = up(env, tp=2)
    finally:
        lab.ssh("spark2", f"mv {STORE}/moved-away {STORE}/hub/models--{repo}")
    assert rep.exit_code() == 2
    msgs = [r.msg for r in rep.results if r.status == "failed" and r.host == "spark2"]
    assert any("weights not staged" in m and "stage-weights llama-3.3-70b" in m for m in msgs), out
    assert containers(lab, "spark1") == [] and containers(lab, "spark2") == []
