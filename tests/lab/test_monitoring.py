"""`invoke monitor up|down` on the lab (issue 25): Prometheus built from Debian's package (the lab's
sparkprov/lab-prometheus image, the lab inventory's prometheus_image) runs on spark1 as a
sparkprov container, scrapes a deployment of lab-tiny on the real vLLM and both node guards (spark1's
on loopback, spark2's over the fabric), and every query of the dashboard `invoke monitor` renders is
run through Prometheus's HTTP API: each returns data. The deployment is lab-tiny with vLLM's n-gram
speculative decoding (a user recipe extending lab-tiny): without it vLLM exports no spec_decode
counters and the two spec-decode panels of the dashboard are empty. A second `monitor up` changes
nothing; `monitor down` leaves no container and no file.
Engine: real vLLM in every test of this module (the shared provisioned lab of test_real_vllm.py)."""

from __future__ import annotations

import json
import time

from sparkprov.data.inventory import load_inventory
from sparkprov.serving import monitor as mon
from sparkprov.serving import prometheus as prom
from tests.lab import test_real_vllm as real
from tests.lab.test_cluster import cli
from tests.lab.test_real_vllm import ask, key_of

env = real.env
nothing_left_running = real.nothing_left_running

SCRAPE_S = 5
RATE_WINDOW = "1m"   # Grafana's $__rate_interval as the dashboard's default range and this scrape interval give it
SCRAPE_BOUND_S = 120
# lab-tiny with vLLM's n-gram speculative decoding (prompt lookup: no draft model), so that the
# dashboard's spec-decode panels have counters to read; the base recipe's arguments, and the one more
NGRAM_RECIPE = """\
recipes:
  - alias: lab-tiny-ngram
    extends: lab-tiny
    title: lab-tiny with n-gram speculative decoding (tests/lab/test_monitoring.py)
    args:
      - --max-model-len: 2048
      - --dtype: float32
      - --max-num-seqs: 16
      - --enforce-eager
      - --speculative-config: {method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 3, prompt_lookup_min: 2}
"""

# Runs inside a lab host (its python3): each query of stdin's JSON through /api/v1/query.
QUERY = r'''
import json, sys, urllib.parse, urllib.request
base, queries = json.load(sys.stdin)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
out = []
for q in queries:
    with opener.open(base + "/api/v1/query?" + urllib.parse.urlencode({"query": q}), timeout=30) as r:
        out.append(json.loads(r.read()))
print(json.dumps(out))
'''


def promql(lab, host: str, base: str, queries: list[str]) -> list[dict]:
    r = lab.exec(host, ["python3", "-c", QUERY], input=json.dumps([base, queries]), timeout=120)
    return json.loads(r.stdout)


def scraped_after(lab, url: str, t: float) -> None:
    """Wait (bounded) until Prometheus scraped every guard and vLLM target after time t (epoch)."""
    t0 = time.monotonic()
    while True:
        (res,) = promql(lab, "spark1", url, ['timestamp(up{job=~"guard|vllm.*"})'])
        stamps = {(s["metric"]["job"], s["metric"]["host"]): float(s["value"][1]) for s in res["data"]["result"]}
        if len(stamps) == 3 and min(stamps.values()) > t:
            return
        assert time.monotonic() - t0 < SCRAPE_BOUND_S, f"not every target scraped within {SCRAPE_BOUND_S}s: {res}"
        time.sleep(1)


def as_run(expr: str) -> str:
    """A dashboard expression as Grafana sends it with every host and deployment picked."""
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$host", ".*").replace("$deployment", ".*")


def dashboard_queries() -> list[tuple[str, str]]:
    dash = mon.dashboard()
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v["query"].removeprefix("label_values(").rsplit(",", 1)[0])
            for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def changed(doc: dict) -> list[dict]:
    return [r for r in doc.get("results", []) if r["status"] == "changed"]


def test_monitor_up_scrapes_every_guard_and_the_deployment_and_every_query_returns_data(env):
    from sparklab.image import PROMETHEUS_IMAGE, ensure_images
    from sparklab.state import BRIDGE_IP, REGISTRY_PORT

    lab = env["lab"]
    t_start = time.monotonic()
    image = load_inventory(lab.inventory).hosts["spark1"].vars["prometheus_image"]
    assert image == PROMETHEUS_IMAGE, image  # the lab's generated inventory names the lab's image
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [image])
    try:
        recipes = env["dir"] / "ngram.yaml"
        recipes.write_text(NGRAM_RECIPE)
        rc, doc, out = cli(env, "cluster-up", "--model", "lab-tiny-ngram", "--recipes", str(recipes), "--tp", "1",
                           "--hosts", "spark1", "--name", "mon", "--health-timeout", "300")
        assert rc == 0, out
        d = doc["cluster"]["deployments"]["mon"]
        key = key_of(env, d)
        rc, check, out = cli(env, "monitor", "up", "--host", "spark1", "--image", image,
                             "--scrape-interval", f"{SCRAPE_S}s", "--check")
        assert rc == 0 and changed(check) and check["monitor"]["check"], out
        assert lab.exec("spark1", ["docker", "ps", "-aq", "--filter", f"name={prom.CONTAINER}"]).stdout == ""
        rc, doc, out = cli(env, "monitor", "up", "--host", "spark1", "--image", image, "--scrape-interval", f"{SCRAPE_S}s")
        assert rc == 0 and len(changed(doc)) == 1, out
        m = doc["monitor"]
        assert m["guards"]["spark1"] == "127.0.0.1:9410" and m["guards"]["spark2"].endswith(":9410"), m
        assert m["deployments"] == ["mon"] and m["bind"] != "0.0.0.0", m
        rc, again, out = cli(env, "monitor", "up", "--host", "spark1", "--image", image, "--scrape-interval", f"{SCRAPE_S}s")
        assert rc == 0 and changed(again) == [], out  # a second run changes nothing
        labels = json.loads(lab.exec("spark1", ["docker", "inspect", "--format", "{{json .Config.Labels}}",
                                                prom.CONTAINER]).stdout)
        assert labels["sparkprov.managed"] == "1" and labels["sparkprov.role"] == prom.ROLE, labels
        rc, st, out = cli(env, "status")
        assert rc == 0 and prom.running_monitor(st["hosts"])["host"] == "spark1", out

        # every target scraped before and after a few requests (counters to take a rate of)
        t0 = time.monotonic()
        scraped_after(lab, m["url"], time.time())
        assert "204" in ask(d["endpoint"], d["model"], key)
        ask(d["endpoint"], d["model"], key, "What is 12*17? The answer is 204. What is 12*17?")  # n-grams to draft from
        # the guard's token probe runs once the engine's counters were still for liveness_every_s (10 s):
        # its reading exists from then on (docs/guard.md)
        probed = None
        for _ in range(60):
            probed = lab.exec("spark1", ["python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                                         "'http://127.0.0.1:9410/metrics', timeout=5).read().decode())"],
                              check=False).stdout
            if "sparkprov_guard_liveness_seconds{" in probed:
                break
            time.sleep(1)
        assert "sparkprov_guard_liveness_seconds{" in probed, probed[-1500:]
        scraped_after(lab, m["url"], time.time() + SCRAPE_S)
        waited = time.monotonic() - t0
        (ups,) = promql(lab, "spark1", m["url"], ['up{job=~"guard|vllm.*"}'])
        assert {(s["metric"]["job"], s["metric"]["host"], s["value"][1]) for s in ups["data"]["result"]} == {
            ("guard", "spark1", "1"), ("guard", "spark2", "1"), ("vllm-spark1", "spark1", "1")}, ups

        queries = dashboard_queries()
        results = promql(lab, "spark1", m["url"], [as_run(e) for _, e in queries])
        empty = []   # a query with no series, or only series whose value is NaN or infinite, shows nothing
        for (where, expr), res in zip(queries, results):
            assert res["status"] == "success", (where, expr, res)
            if not any(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in res["data"]["result"]):
                empty.append((where, expr, [s["value"][1] for s in res["data"]["result"]]))
        assert empty == [], f"queries without a finite value: {empty}"
        hosts = {s["metric"]["host"] for s in results[[w for w, _ in queries].index("variable host")]["data"]["result"]}
        assert hosts == {"spark1", "spark2"}, hosts

        rc, doc, out = cli(env, "monitor", "down")
        assert rc == 0 and [r["host"] for r in changed(doc)] == ["spark1"], out
        assert lab.exec("spark1", ["docker", "ps", "-aq", "--filter", f"name={prom.CONTAINER}"]).stdout == ""
        assert lab.ssh("spark1", f"test -e {prom.DIR} && echo left").stdout == ""
        rc, doc, out = cli(env, "monitor", "down")
        assert rc == 0 and changed(doc) == [], out
        print(f"\n[monitor, real vLLM tp1 (n-gram spec decoding) + 2 guards] {len(queries)} of {len(queries)} "
              f"dashboard queries returned a finite value; scrapes waited for {waited:.0f}s; "
              f"test {time.monotonic() - t_start:.0f}s")
    finally:
        cli(env, "monitor", "down")
