"""`invoke plan MODEL`: every layout of a model on N Sparks, memory per node, the pick and its rule
(sparkprov/catalog/layout_plan.py on literal data; the task through Invoke on the catalog)."""

import json
import textwrap

import pytest
from invoke import Context, Exit

from sparkprov.catalog.layout_plan import (DP_ONE_API, GATEWAY, ONE_ENGINE, REPLICAS_FROM_CONCURRENCY, ModelFigures,
                                           Spark, latest_bench, node_memory, pick, plan_layouts, shapes)
from sparkprov.catalog.memory import (GIB, HOST_MEMORY_GIB, RUNTIME_OVERHEAD_GIB, AttentionLayers, KvSettings,
                                      KvShape)
from sparkprov.cli import plan as cli

# Llama-3.3-70B BF16 as the catalog has it: 141 GB of weights (131.3 GiB), 80 layers x 8 KV heads x
# 128 x 2 bytes x 2 (K, V) = 320 KiB per token on one GPU, util 0.85, --max-model-len 32768
LLAMA = ModelFigures(alias="llama", utilization=0.85, weights_gib=141e9 / 2**30,
                     shape=KvShape((AttentionLayers(80, 8, 128),)), kv=KvSettings(max_model_len=32_768))
# a model one Spark holds: 20 GiB of weights, 16 KiB per token (8 layers x 2 KV heads x 256 x BF16 x K, V)
SMALL = ModelFigures(alias="small", utilization=0.85, weights_gib=20.0, shape=KvShape((AttentionLayers(8, 2, 256),)),
                     kv=KvSettings(max_model_len=65_536))
TWO = [Spark("spark1"), Spark("spark2")]


def allow_all(tp, pp, dp):
    return (ONE_ENGINE if dp == 1 else DP_ONE_API if tp * pp == 1 else GATEWAY), ("native" if tp * pp > 1 else None), None


def test_shapes_are_every_factorization_largest_tp_first():
    assert shapes(1) == [(1, 1, 1)]
    assert shapes(2) == [(2, 1, 1), (1, 1, 2), (1, 2, 1)]
    four = shapes(4)
    assert four[0] == (4, 1, 1) and len(four) == 6 and all(t * p * d == 4 for t, p, d in four)
    assert (2, 1, 2) in four and (1, 2, 2) in four and (1, 4, 1) in four


def test_node_memory_splits_weights_and_kv_over_tp_and_pp():
    budget = 0.85 * HOST_MEMORY_GIB
    tp2 = node_memory(LLAMA, TWO[0], 2, 1)
    assert tp2.weights_gib == pytest.approx(LLAMA.weights_gib / 2)
    assert tp2.kv_pool_gib == pytest.approx(budget - LLAMA.weights_gib / 2 - RUNTIME_OVERHEAD_GIB)
    # 4 KV heads per rank: 160 KiB a token; vLLM's blocks hold 16 tokens of all 80 layers
    assert tp2.tokens == int(tp2.kv_pool_gib * GIB) // (16 * 163_840) * 16
    assert tp2.bytes_per_token == pytest.approx(163_840, rel=1e-4)
    pp2 = node_memory(LLAMA, TWO[0], 1, 2)  # half the layers: half the weights and half the KV per token
    assert pp2.weights_gib == tp2.weights_gib and pp2.tokens == tp2.tokens
    one = node_memory(LLAMA, TWO[0], 1, 1)
    assert one.kv_pool_gib == pytest.approx(budget - LLAMA.weights_gib - RUNTIME_OVERHEAD_GIB) and one.kv_pool_gib < 0
    tp16 = node_memory(LLAMA, TWO[0], 16, 1)  # 8 KV heads over 16 ranks: each keeps one (replicated)
    assert tp16.bytes_per_token == pytest.approx(327_680 / 8, rel=1e-3)


def test_a_modeset0_host_plans_at_its_cap_and_its_own_memory():
    capped = Spark("spark2", host_gib=121.69, utilization_cap=0.55)
    n = node_memory(SMALL, capped, 1, 1)
    assert n.utilization == 0.55 and n.budget_gib == pytest.approx(0.55 * 121.69)
    assert n.kv_pool_gib == pytest.approx(0.55 * 121.69 - 20.0 - RUNTIME_OVERHEAD_GIB)


def test_llama_on_two_sparks_lists_tp2_pp2_and_replicas_that_do_not_fit():
    plans = plan_layouts(LLAMA, TWO, counts=[2], rules=allow_all, concurrency=4)
    by = {p.describe(): p for p in plans}
    assert set(by) == {"tp 2", "tp 1 x pp 2", "2 replicas"}
    assert by["tp 2"].fits and by["tp 1 x pp 2"].fits and by["tp 2"].covers
    reps = by["2 replicas"]
    assert not reps.fits and reps.does_not_fit.startswith("does not fit: spark1 budget 101.7 GiB (util 0.85)")
    assert "weights 131.3 GiB" in reps.does_not_fit and "KV pool -32.9 GiB" in reps.does_not_fit
    chosen = pick(plans, 4)
    assert chosen.plan is by["tp 2"] and "largest tp" in chosen.why and "2.09x" in chosen.why


def test_pick_prefers_replicas_at_high_concurrency_when_one_spark_holds_the_model():
    plans = plan_layouts(SMALL, TWO, counts=[2], rules=allow_all, concurrency=REPLICAS_FROM_CONCURRENCY)
    chosen = pick(plans, REPLICAS_FROM_CONCURRENCY)
    assert chosen.plan.describe() == "2 replicas" and chosen.plan.mode == DP_ONE_API and "1.30x at 8" in chosen.why
    low = pick(plan_layouts(SMALL, TWO, counts=[2], rules=allow_all, concurrency=1), 1)
    assert low.plan.describe() == "tp 2"


def test_pick_takes_the_fewest_sparks_without_hosts_and_none_when_nothing_fits():
    plans = plan_layouts(SMALL, TWO, counts=[1, 2], rules=allow_all, concurrency=1)
    assert pick(plans, 1).plan.describe() == "tp 1"
    nothing = pick(plan_layouts(LLAMA, TWO[:1], counts=[1], rules=allow_all, concurrency=1), 1)
    assert nothing.plan is None and "no layout the rules allow fits in memory" in nothing.why
    refuse_all = plan_layouts(SMALL, TWO, counts=[2], rules=lambda tp, pp, dp: (ONE_ENGINE, None, "a rule"),
                              concurrency=1)
    assert "the layout rules refuse every layout" in pick(refuse_all, 1).why


def test_a_refused_layout_is_listed_with_its_reason_and_never_picked():
    def no_tp2(tp, pp, dp):
        mode, executor, _ = allow_all(tp, pp, dp)
        return mode, executor, "--tp 2: small runs at tp 1 (G35)" if tp == 2 else None

    plans = plan_layouts(SMALL, TWO, counts=[2], rules=no_tp2, concurrency=1)
    tp2 = next(p for p in plans if p.tp == 2)
    assert tp2.refused and not tp2.fits and tp2.does_not_fit is None
    chosen = pick(plans, 1)  # one Spark holds it: replicas before pipeline stages (smallest pp)
    assert chosen.plan.describe() == "2 replicas" and "no tp layout is allowed" in chosen.why


def test_measured_bench_results_decide_between_fitting_layouts():
    records = [
        {"recipe": "small", "tp": "2", "time": "2026-11-01T00:00:00Z", "rows": [{"concurrency": 16, "output_throughput": 300.0}]},
        {"recipe": "small", "tp": "2", "time": "2026-11-02T00:00:00Z", "rows": [{"concurrency": 16, "output_throughput": 310.0}]},
        {"recipe": "small", "tp": "1", "time": "2026-11-01T00:00:00Z",  # the layout as provenance records it
         "provenance": {"layout": {"tp": 1, "pp": 1, "dp": 2, "nodes": 2}},
         "rows": [{"concurrency": 16, "output_throughput": 280.0}]},
        {"recipe": "other", "tp": "1", "time": "2026-11-03T00:00:00Z", "rows": []},
    ]
    bench = latest_bench(records, "small")
    assert set(bench) == {(2, 1, 1), (1, 1, 2)} and bench[(2, 1, 1)]["time"].startswith("2026-11-02")
    plans = plan_layouts(SMALL, TWO, counts=[2], rules=allow_all, concurrency=16, bench=bench)
    chosen = pick(plans, 16)  # the rule alone would take the replicas (16 >= 8): the measurement wins
    assert chosen.plan.describe() == "tp 2" and "310.0 output tok/s" in chosen.why


# ---- the task, over the catalog


@pytest.fixture
def inventory(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(textwrap.dedent("""
        hosts:
          spark1: {address: 10.77.0.11}
          spark2: {address: 10.77.0.12, vars: {max_gpu_memory_utilization: 0.80}}
    """))
    return str(inv)


def test_plan_llama_on_two_hosts_prints_every_layout_with_memory_per_node(inventory, tmp_path, capsys):
    cli.plan(Context(), "llama-3.3-70b", hosts="spark1,spark2", inventory=inventory, results=str(tmp_path))
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if line[:1].isalnum()}
    assert {"tp 2", "tp 1 x pp 2", "2 replicas"} <= set(rows)
    assert "does not fit" in rows["2 replicas"] and "weights 131.3 GiB" in rows["2 replicas"]
    assert "65.7" in rows["tp 2"]  # half the 131.3 GiB of weights on each node
    # spark2 is capped at 0.80 (max_gpu_memory_utilization): the row shows the tighter node
    assert "95.7" in rows["tp 2"] and "26.8" in rows["tp 2"]
    picked = [line for line in out.splitlines() if line.startswith("pick: ")]
    assert len(picked) == 1 and picked[0].startswith("pick: tp 2 (--tp 2 --executor native): ")
    assert "rule:" in out and "  4. else, concurrency >= 8" in out


def test_plan_json_and_stored_bench_results(tmp_path, capsys):
    run = tmp_path / "bench" / "q" / "abc123"
    run.mkdir(parents=True)
    (run / "20261101T000000Z-spark1-x.json").write_text(json.dumps(
        {"recipe": "qwen3.5-35b-a3b-fp8", "tp": "1", "host": "spark1", "time": "2026-11-01T00:00:00Z",
         "rows": [{"concurrency": 4, "output_throughput": 123.4, "ttft_p50_ms": 250}]}))
    (run / "broken.json").write_text("{not json")
    cli.plan(Context(), "qwen3.5-35b-a3b-fp8", sparks=2, json=True, results=str(tmp_path / "bench"))
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_source"] == "measured" and doc["pick"]["layout"] == "tp 1"
    one = next(p for p in doc["layouts"] if p["layout"] == "tp 1")
    assert one["engine_tokens"] == 820_000 and one["bench"]["rows"][0]["output_throughput"] == 123.4
    assert one["nodes"][0]["measured"] is True  # 000's pool; a split layout's is the layers', and says so
    assert [n["measured"] for n in next(p for p in doc["layouts"] if p["layout"] == "tp 1 x pp 2")["nodes"]] == [False] * 2
    cli.plan(Context(), "qwen3.5-35b-a3b-fp8", sparks=1, results=str(tmp_path / "bench"))
    assert "measured: concurrency 4: 123.4 output tok/s" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "no-such-model"}, "unknown model alias 'no-such-model'"),
    ({"model": "llama-3.3-70b", "hosts": "spark9"}, "unknown host or group 'spark9'"),
    ({"model": "llama-3.3-70b", "hosts": "spark1", "sparks": "2"}, "--sparks and --hosts"),
    ({"model": "llama-3.3-70b", "concurrency": "many"}, "--concurrency"),
    ({"model": "llama-3.3-70b", "results": "/dev/null"}, "--results '/dev/null' is not a folder"),
])
def test_plan_bad_input_is_one_line_exit_1(inventory, kwargs, message):
    with pytest.raises(Exit) as err:
        cli.plan(Context(), **({"inventory": inventory} if "hosts" in kwargs else {}), **kwargs)
    text = str(err.value.message)
    assert err.value.code == 1 and message in text and "\n" not in text


def test_gpt_oss_120b_on_two_sparks_follows_the_measured_figures(inventory, tmp_path, capsys):
    """Issue 23: two single-Spark replicas of gpt-oss-120b behind LiteLLM beat TP 2 at 64 concurrent
    requests; unsloth PR#10280: TP 2 is 2.09x per token for one user. The old rule let the pool's
    cover decide first and picked TP 2 (more tokens) at 64; the measured figures decide now."""
    cli.plan(Context(), "gpt-oss-120b", hosts="spark1,spark2", inventory=inventory, concurrency="64", json=True,
             results=str(tmp_path))
    doc = json.loads(capsys.readouterr().out)
    rows = {p["layout"]: p for p in doc["layouts"]}
    assert rows["tp 2"]["fits"] and rows["tp 2"]["total_tokens"] > rows["2 replicas"]["total_tokens"]
    assert doc["pick"]["layout"] == "2 replicas" and "issue 23" in doc["why"]
    cli.plan(Context(), "gpt-oss-120b", hosts="spark1,spark2", inventory=inventory, concurrency="1", json=True,
             results=str(tmp_path))
    one = json.loads(capsys.readouterr().out)
    assert one["pick"]["layout"] == "tp 2" and "2.09x" in one["why"]


def test_a_pool_that_covers_does_not_outvote_the_measured_replicas():
    # 60 GiB of weights, 64 KiB a token: one Spark's pool holds ~630K tokens, fewer than the 12 x
    # 65,536 each replica takes at 24 concurrent; tp 2's (weights and KV split) covers 24 x 65,536.
    # The replicas still win: the measurements were taken on real pools with real requests.
    big = ModelFigures(alias="big", utilization=0.85, weights_gib=60.0, shape=KvShape((AttentionLayers(16, 8, 128),)),
                       kv=KvSettings(max_model_len=65_536))
    plans = plan_layouts(big, TWO, counts=[2], rules=allow_all, concurrency=24)
    by = {p.describe(): p for p in plans}
    assert by["tp 2"].covers is True and by["2 replicas"].covers is False and by["2 replicas"].fits
    chosen = pick(plans, 24)
    assert chosen.plan is by["2 replicas"] and "1.91x at 32" in chosen.why and "fewer than" in chosen.why
