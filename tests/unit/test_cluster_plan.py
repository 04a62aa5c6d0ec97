"""cluster-up's pure parts: the serve playbook, container specs, staged-weights check, parsers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import KEY_PATH, HostServeContext, render_launch
from sparkprov.facts import probe
from sparkprov.serving import spec
from sparkprov.serving.allreduce_bench import busbw, parse_size, sizes
from sparkprov.facts.serving import parse_containers, parse_ray_status
from sparkprov.serving.node import staged_problem
from sparkprov.serving.deployment import load_serve_playbook, select
from sparkprov.data.inventory import load_inventory
from sparkprov.errors import InputError
from sparkprov.staging.plan import Entry, Record, StoreFacts

REPO = Path(__file__).resolve().parents[2]
INV = """
hosts:
  spark1: {address: 10.77.0.11}
  spark2: {address: 10.77.0.12}
groups:
  sparks: [spark1, spark2]
"""


@pytest.fixture
def inv(tmp_path):
    p = tmp_path / "inventory.yaml"
    p.write_text(INV)
    return load_inventory(p)


def book(tmp_path, text):
    p = tmp_path / "serve.yaml"
    p.write_text(text)
    return p


def test_shipped_playbooks_load(inv):
    c = load_serve_playbook(REPO / "playbooks" / "cluster.yaml", inv)
    assert [(d.name, d.tp, d.hosts) for d in c.deployments] == [("llama70b", 2, ["spark1", "spark2"])]
    s = load_serve_playbook(REPO / "playbooks" / "serve.yaml", inv)
    assert {d.hosts[0] for d in s.deployments} == {"spark1", "spark2"} and all(d.tp == 1 for d in s.deployments)
    cat = load_catalog()
    for d in c.deployments + s.deployments:
        assert d.tp in cat.get(d.model).tp_sizes


@pytest.mark.parametrize("text,where,msg", [
    ("deployments:\n  - name: a\n    model: x\n    hosts: spark9\n", ":4:12:", "unknown host or group 'spark9'"),
    ("deployments:\n  - name: a\n    model: x\n    hosts: sparks\n    tp: 3\n", ":5:9:", "tp 3 needs exactly 3 hosts"),
    ("deployments:\n  - name: a\n    model: x\n    hosts: spark1\n    overrides: {--api-key: k}\n", ":5:", "--api-key in argv"),
    ("deployments:\n  - name: a\n    model: x\n    hosts: spark1\n    colour: red\n", ":5:5:", "unknown key 'colour'"),
    ("deployments:\n  - {name: a, model: x, hosts: spark1}\n  - {name: b, model: y, hosts: spark1}\n", ":3:", "shares host spark1"),
])
def test_playbook_errors_are_positioned(tmp_path, inv, text, where, msg):
    with pytest.raises(InputError) as e:
        load_serve_playbook(book(tmp_path, text), inv)
    line = e.value.line()
    assert where in line and msg in line, line


def test_select_by_tp_and_hosts(tmp_path, inv):
    pb = load_serve_playbook(book(tmp_path, "deployments:\n  - {name: a, model: x, hosts: sparks}\n"
                                            "  - {name: b, model: y, hosts: sparks, tp: 2, port: 8001}\n"), inv)
    assert [d.name for d in select(pb, tp=2, hosts=None, names=None)] == ["b"]
    assert [d.hosts for d in select(pb, tp=1, hosts=["spark2"], names=None)] == [["spark2"]]
    with pytest.raises(InputError, match="2-node cluster"):
        select(pb, tp=2, hosts=["spark2"], names=None)
    with pytest.raises(InputError, match="no deployment matches tp 4"):
        select(pb, tp=4, hosts=None, names=None)


def ctx(host, ip, **kw):
    return HostServeContext(host=host, host_known=True, model_store="/home/nvidia/vllm",
                            compile_cache="/home/nvidia/vllm-compile-cache",
                            api_key_file="/home/nvidia/.config/sparkprov/api_key", fabric_ifaces=["enp1s0f1np1"],
                            ib_hcas=["rocep1s0f1", "roceP2p1s0f1"], node_ip=ip, cluster_size=2, **kw)


def cluster_specs(overrides=None, ip2="192.168.100.12"):
    cat = load_catalog()
    r = cat.get("llama-3.3-70b")
    launches = [(h, render_launch(r, ctx(h, ip, container_name=n), 2, overrides, catalog=cat))
                for h, ip, n in (("spark1", "192.168.100.11", "sparkprov-l-head"),
                                 ("spark2", ip2, "sparkprov-l-worker"))]
    return [spec.ray_rank("l", h, launch, rank=i, nnodes=2, head_ip="192.168.100.11", ray_port=6379)
            for i, (h, launch) in enumerate(launches)]


def test_cluster_specs_head_and_worker():
    head, worker = cluster_specs()
    assert (head.name, head.role, worker.role) == ("sparkprov-l-head", "ray-head", "ray-worker")
    for s in (head, worker):
        a = s.argv
        assert a[:3] == ["docker", "run", "-d"] and "--init" in a and a[a.index("--network") + 1] == "host"
        assert f"sparkprov.recipe_hash={s.hash}" in a and "sparkprov.managed=1" in a
        assert "sparkprov.deployment=l" in a and f"sparkprov.role={s.role}" in a
        env = [a[i + 1] for i, w in enumerate(a) if w == "-e"]
        assert "NCCL_SOCKET_IFNAME=enp1s0f1np1" in env and "GLOO_SOCKET_IFNAME=enp1s0f1np1" in env
        assert "UCX_NET_DEVICES=enp1s0f1np1" in env and "NCCL_IB_HCA=rocep1s0f1,roceP2p1s0f1" in env
        assert "HF_HUB_OFFLINE=1" in env and "HF_HOME=/home/nvidia/vllm" in env
        assert not any(e.startswith(("VLLM_API_KEY", "HF_TOKEN")) for e in env)  # never in the container config
        assert "--api-key" not in a
    env_h = [head.argv[i + 1] for i, w in enumerate(head.argv) if w == "-e"]
    env_w = [worker.argv[i + 1] for i, w in enumerate(worker.argv) if w == "-e"]
    assert "VLLM_HOST_IP=192.168.100.11" in env_h and "SPARKPROV_RAY_GPUS=2" in env_h
    assert "VLLM_HOST_IP=192.168.100.12" in env_w and "SPARKPROV_RAY_HEAD=192.168.100.11:6379" in env_w
    assert f"/home/nvidia/.config/sparkprov/api_key:{KEY_PATH}:ro" in head.argv
    assert not any(KEY_PATH in w for w in worker.argv if w.startswith("/"))
    # NGC image: its own entrypoint stays (G5), the wrapper is the command
    i = head.argv.index(head.image)
    assert "--entrypoint" not in head.argv and head.argv[i + 1:i + 3] == ["sh", "-c"]
    tail = head.argv[i + 4:]
    assert tail[:3] == ["sparkprov-ray-head", "vllm", "serve"]
    assert tail[tail.index("--tensor-parallel-size") + 1] == "2"
    assert tail[tail.index("--distributed-executor-backend") + 1] == "ray"


def test_hashes_are_stable_and_follow_the_recipe():
    a, b = cluster_specs(), cluster_specs()
    assert [s.hash for s in a] == [s.hash for s in b]
    c = cluster_specs({"--max-model-len": 16384})
    assert a[0].hash != c[0].hash
    d = cluster_specs(ip2="192.168.100.99")  # a worker's fabric address is part of its container
    assert a[0].hash == d[0].hash and a[1].hash != d[1].hash


def native_specs(pp=1, rank0_id=""):
    cat = load_catalog()
    r = cat.get("llama-3.3-70b")
    out = []
    for rank, (h, ip) in enumerate((("spark1", "192.168.100.11"), ("spark2", "192.168.100.12"))):
        launch = render_launch(r, ctx(h, ip, container_name=f"sparkprov-l-rank{rank}"), 2, None, catalog=cat)
        out.append(spec.native_rank("l", h, launch, rank=rank, nnodes=2, pp=pp, master_addr="192.168.100.11",
                                    master_port=29501, rank0_id=rank0_id))
    return out


def test_native_executor_ranks():
    """vLLM's own multi-node: every rank runs vllm serve with --nnodes/--node-rank/--master-addr on
    the fabric; rank 0 serves the API (key file), the others are --headless; no Ray anywhere."""
    r0, r1 = native_specs()
    assert (r0.role, r1.role) == ("rank0", "rank") and r0.serves and not r1.serves
    for rank, s in enumerate((r0, r1)):
        a = s.argv
        tail = a[a.index("serve") - 1:]
        assert tail[tail.index("--nnodes") + 1] == "2" and tail[tail.index("--node-rank") + 1] == str(rank)
        assert tail[tail.index("--master-addr") + 1] == "192.168.100.11"
        assert tail[tail.index("--master-port") + 1] == "29501"
        assert tail[tail.index("--tensor-parallel-size") + 1] == "2"
        assert "--distributed-executor-backend" not in a and not any("ray" in w.split() for w in a)
        assert not any("pip install" in w for w in a)
        assert ("--headless" in tail) == (rank == 1)
        assert "sparkprov.executor=native" in a and f"sparkprov.rank={rank}" in a and "sparkprov.nodes=2" in a
    assert f"/home/nvidia/.config/sparkprov/api_key:{KEY_PATH}:ro" in r0.argv
    assert not any(KEY_PATH in w for w in r1.argv if w.startswith("/"))
    i = r0.argv.index("-c")
    assert subprocess.run(["sh", "-n", "-c", r0.argv[i + 1]]).returncode == 0


def test_other_ranks_are_replaced_with_rank0():
    """A group does not re-admit a lost member: a rank's hash follows rank 0's container ID."""
    a, b = native_specs(rank0_id="aaaaaaaaaaaa1111"), native_specs(rank0_id="bbbbbbbbbbbb2222")
    assert a[0].hash == b[0].hash and a[1].hash != b[1].hash
    w1 = cluster_specs()[1]
    from sparkprov.serving.spec import ray_rank
    w2 = ray_rank("l", "spark2", w1.launch, rank=1, nnodes=2, head_ip="192.168.100.11", ray_port=6379,
                  rank0_id="cccccccccccc")
    assert w1.hash != w2.hash and "SPARKPROV_RANK0=cccccccccccc" in w2.argv


def test_pipeline_parallel_spans_tp_times_pp_nodes(tmp_path, inv):
    p = tmp_path / "serve.yaml"
    p.write_text("deployments:\n  - {name: a, model: llama-3.3-70b, hosts: [spark1, spark2], tp: 1, pp: 2, executor: native}\n")
    d = load_serve_playbook(p, inv).deployments[0]
    assert (d.nodes, d.cluster, d.executor) == (2, True, "native")
    r0, _ = native_specs(pp=2)
    tail = r0.argv[r0.argv.index("serve"):]
    assert tail[tail.index("--pipeline-parallel-size") + 1] == "2"
    p.write_text("deployments:\n  - {name: a, model: llama-3.3-70b, hosts: [spark1, spark2], tp: 2, pp: 2}\n")
    with pytest.raises(InputError, match="tp 2 x pp 2 needs exactly 4 hosts"):
        load_serve_playbook(p, inv)


def test_wrapper_scripts_are_valid_sh():
    for head in cluster_specs():
        i = head.argv.index("-c")
        assert subprocess.run(["sh", "-n", "-c", head.argv[i + 1]]).returncode == 0


def test_single_spec_is_the_catalog_launch_plus_labels():
    cat = load_catalog()
    launch = render_launch(cat.get("qwen3-coder-next"), HostServeContext(
        host="spark2", host_known=True, container_name="sparkprov-coder", model_store="/home/n/vllm",
        compile_cache="/home/n/cc", api_key_file="/home/n/.config/sparkprov/api_key"), 1, catalog=cat)
    s = spec.single("coder", "spark2", launch)
    shown = spec.recipe_container(launch)  # what `invoke recipe` prints
    no_labels = [w for i, w in enumerate(s.argv) if w != "--label" and (i == 0 or s.argv[i - 1] != "--label")]
    want = [w for i, w in enumerate(shown.argv) if w != "--label" and (i == 0 or shown.argv[i - 1] != "--label")]
    assert no_labels == want and s.hash == shown.hash
    assert "sparkprov.port=8000" in s.argv and "sparkprov.model=qwen3-coder-next" in s.argv


def store(entries, verified, refs):
    f = StoreFacts(store="/s")
    f.entries = {p: Entry(*e) for p, e in entries.items()}
    f.verified = {p: Record(*r) for p, r in verified.items()}
    f.refs = refs
    return f


def test_staged_problem():
    base = "hub/models--o--m"
    c = "a" * 40
    entries = {f"{base}/snapshots/{c}/config.json": ("l", 10, 1, "../../blobs/b1"),
               f"{base}/snapshots/{c}/model.safetensors": ("l", 10, 1, "../../blobs/b2"),
               f"{base}/blobs/b1": ("f", 5, 100, ""), f"{base}/blobs/b2": ("f", 9, 200, "")}
    ok = store(entries, {f"{base}/blobs/b1": (5, 100, "git:x"), f"{base}/blobs/b2": (9, 200, "sha256:y")},
               {f"{base}/refs/main": c})
    assert staged_problem(ok, "o/m", "main") is None
    assert "not in the store" in staged_problem(store({}, {}, {}), "o/m", "main")
    touched = store(entries, {f"{base}/blobs/b1": (5, 100, "git:x"), f"{base}/blobs/b2": (9, 199, "sha256:y")},
                    {f"{base}/refs/main": c})
    assert "model.safetensors is not verified" in staged_problem(touched, "o/m", "main")
    gone = dict(entries)
    del gone[f"{base}/blobs/b2"]
    assert "missing blob" in staged_problem(store(gone, {f"{base}/blobs/b1": (5, 100, "git:x")},
                                                  {f"{base}/refs/main": c}), "o/m", "main")


def test_ray_status_parse():
    text = """======== Autoscaler status: 2026-01-01 ========
Node status
---------------------------------------------------------------
Active:
 1 node_83e4b7723832f251eff177c9faf45a5305de7b1755a7f91ce1f3c911
 1 node_4dcd7509dc73bd2e758e4048d40233b19eb019dfb54c66095a01e30f
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/40.0 CPU
 0.0/2.0 GPU
 0B/221.76GiB memory
 0B/19.46GiB object_store_memory
"""
    r = parse_ray_status(text)
    assert (r["nodes"], r["gpus"], r["gpus_used"], r["ok"]) == (2, 2.0, 0.0, True)
    assert parse_ray_status("ConnectionError: could not find any running Ray instance")["ok"] is False


def test_containers_parse():
    labels = json.dumps({"sparkprov.managed": "1", "sparkprov.deployment": "x"})
    out = f"/sparkprov-x\tabc\tsha256:1\timg:tag\trunning\t0\t2\t2026-01-01T00:00:00Z\t{labels}\n"
    c = parse_containers(out)["containers"][0]
    assert (c["name"], c["status"], c["restarts"], c["labels"]["sparkprov.deployment"]) == ("sparkprov-x", "running", 2, "x")
    assert parse_containers("@noaccess permission denied")["access"] is False


def test_metrics_parse():
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 24.0\n'
            '# HELP x\nvllm:num_requests_running{engine="0",model_name="m"} 1.0\n')
    m = probe.metrics(text)
    assert m["kv_cache_usage"] == 0.25 and m["spec_acceptance"] == 0.8 and m["running"] == 1.0
    assert abs(m["spec_mean_accepted_length"] - 3.4) < 1e-9


def test_probe_program_compiles():
    compile(probe.PROGRAM, "probe", "exec")
    s = probe.script("state", "http://127.0.0.1:8000", "/k", {"metrics": True})
    assert s.startswith("python3 - state") and s.rstrip().endswith("SPARKPROV_PROBE")


def test_bench_math():
    assert busbw(10.0, 2) == 10.0 and busbw(10.0, 4) == 15.0 and busbw(10.0, 8) == 17.5
    assert parse_size("2G") == 2 << 30 and parse_size("1M") == 1 << 20 and parse_size("256k") == 256 << 10
    assert sizes(1 << 20, 1 << 24, 4) == [1 << 20, 1 << 22, 1 << 24]


def test_api_key_file_has_one_default_for_recipe_and_cluster_up(tmp_path):
    """No api_key_file in the inventory: `invoke recipe --host` and cluster-up both use
    ~/.config/sparkprov/api_key on the head, in the login user's home."""
    from sparkprov.catalog.render import DEFAULT_API_KEY_FILE
    from sparkprov.cli.catalog import _ctx
    from sparkprov.defaults import API_KEY_FILE, expand_home
    from sparkprov.serving import node

    assert API_KEY_FILE == DEFAULT_API_KEY_FILE == "~/.config/sparkprov/api_key"
    p = tmp_path / "inventory.yaml"
    p.write_text(INV)
    loaded = load_inventory(p)
    shown = _ctx("spark1", str(p), 2)  # what `invoke recipe ALIAS --host spark1` renders
    up = expand_home(node.key_file(loaded.hosts["spark1"].vars), "/home/nvidia")  # what cluster-up uses
    assert shown.api_key_file == up == "/home/nvidia/.config/sparkprov/api_key"
    launch = render_launch(load_catalog().get("qwen3.6-27b"), shown, 1)
    assert f"/home/nvidia/.config/sparkprov/api_key:{KEY_PATH}:ro" in spec.recipe_container(launch).argv
    assert HostServeContext.from_host_vars("h", {}, home="/root").api_key_file == "/root/.config/sparkprov/api_key"
    assert HostServeContext.from_host_vars("h", {"api_key_file": None}, home="/root").api_key_file is None
    assert HostServeContext.from_host_vars("h", {"api_key_file": "/etc/k"}, home="/root").api_key_file == "/etc/k"
    assert HostServeContext().api_key_file == "~/.config/sparkprov/api_key"  # no host: the login user's ~


def test_docker_unreachable_reason_is_dockers_own_line(tmp_path):
    """docker 20.10's client, daemon down: a blank line and a `Server:` heading come before the
    reason; the failure names the reason, not "docker is not reachable"."""
    import os
    import subprocess

    from sparkprov.facts.serving import ManagedContainers, parse_containers
    from sparkprov.facts.base import ShellCtx

    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\nprintf '\\nServer:\\nERROR: Cannot connect to the Docker daemon at "
                    "unix:///var/run/docker.sock. Is the docker daemon running?\\n' >&2; exit 1\n")
    fake.chmod(0o755)
    out = subprocess.run(["sh", "-c", ManagedContainers().command(ShellCtx("/root"))], capture_output=True,
                         text=True, env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}).stdout
    parsed = parse_containers(out)
    assert parsed["access"] is False
    assert parsed["error"].startswith("ERROR: Cannot connect to the Docker daemon")


def test_recipe_shows_every_nodes_command_per_executor(tmp_path):
    """`invoke recipe ALIAS --tp 2 --executor native|ray`: each node's docker run, from the code
    cluster-up runs (a derived Ray image named where the image ships no Ray)."""
    inv = REPO / ".venv" / "bin" / "invoke"
    hosts = ["--hosts", "spark1,spark2", "--inventory", str(tmp_path / "inv.yaml")]
    (tmp_path / "inv.yaml").write_text("hosts:\n" + "".join(
        f"  spark{i}: {{address: 10.0.0.{i}, vars: {{fabric_ip: 192.168.100.1{i}, fabric_ifaces: enp1s0f1np1}}}}\n"
        for i in (1, 2)))
    native = subprocess.run([str(inv), "recipe", "llama-3.3-70b", "--tp", "2", "--executor", "native", "--argv",
                             *hosts], cwd=REPO, capture_output=True, text=True)
    assert native.returncode == 0, native.stderr
    ranks = json.loads(native.stdout)
    r0, r1 = ranks["spark1"], ranks["spark2"]
    assert "--headless" in r1 and "--headless" not in r0
    assert r1[r1.index("--master-addr") + 1] == "192.168.100.11" and "--nnodes" in r0
    ray = subprocess.run([str(inv), "recipe", "llama-3.3-70b", "--tp", "2", "--executor", "ray", *hosts], cwd=REPO,
                         capture_output=True, text=True)
    assert ray.returncode == 0 and "ships no Ray: cluster-up runs sparkprov/ray-" in ray.stdout
    assert ray.stdout.count("docker run -d") == 2 and "pip install" not in ray.stdout
    bad = subprocess.run([str(inv), "recipe", "llama-3.3-70b", "--tp", "2", "--executor", "mpi"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_unknown_model_in_a_serve_playbook_names_its_place(tmp_path):
    (tmp_path / "serve.yaml").write_text("deployments:\n  - {name: a, model: llama-3.3-70bb, hosts: spark1}\n")
    (tmp_path / "inv.yaml").write_text("hosts:\n  spark1: {address: 127.0.0.1, port: 9}\n")
    p = subprocess.run([str(REPO / ".venv" / "bin" / "invoke"), "cluster-up", "--playbook", str(tmp_path / "serve.yaml"),
                        "--inventory", str(tmp_path / "inv.yaml")], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.strip() == (
        f"sparkprov: {tmp_path / 'serve.yaml'}:2:5: deployment 'a': unknown model alias 'llama-3.3-70bb' "
        "(fix: did you mean 'llama-3.3-70b'?)")
