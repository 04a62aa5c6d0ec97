"""The memory planner, checked against the numbers the notes print."""

import pytest

from sparkprov.catalog.memory import (GIB, HOST_MEMORY_GIB, PlanError, budget_gib, concurrency, freed_vs,
                                      kv_bytes_per_token, plan_host, plan_model, pool_tokens)


def test_001_log_pool_tokens_and_concurrency():
    # 001 §8: "Available KV cache memory: 76.49 GiB", "GPU KV cache size: 4,843,965 tokens",
    # "Maximum concurrency for 65,536 tokens per request: 73.91x", "~16.6 KB/token" (fp8)
    bpt = 76.49 * GIB / 4_843_965
    assert bpt / 1024 == pytest.approx(16.6, abs=0.05)  # the note's "KB" is KiB
    tokens = pool_tokens(76.49, bpt)
    assert abs(tokens - 4_843_965) <= 1
    assert round(concurrency(tokens, 65_536), 2) == 73.91


def test_001_16_6_kib_per_token_gives_4_84m_tokens():
    tokens = pool_tokens(76.49, 16.6 * 1024)
    assert round(tokens / 1e6, 2) == 4.83 or round(tokens / 1e6, 2) == 4.84
    assert concurrency(tokens, 65_536) == pytest.approx(73.9, abs=0.2)


def test_001_pool_derives_from_util_weights_and_overhead():
    # util 0.85 x 119.6 GiB - 21.94 GiB weights - 3.2 GiB overhead ~= the logged 76.49 GiB
    plan = plan_model("qwen3.6-35b-a3b", gpu_memory_utilization=0.85, weights_gib=21.94,
                      bytes_per_token=76.49 * GIB / 4_843_965, max_model_len=65_536, max_num_seqs=4)
    assert plan.kv_pool_gib == pytest.approx(76.49, abs=0.1)
    assert plan.concurrency == pytest.approx(73.91, abs=0.15)
    assert plan.fits_one_sequence


def test_001_256k_walkthrough_one_sequence_is_about_4_gb():
    # 001 §8: one 256K sequence ~= 262,144 x 16.6 KB ~= ~4 GB
    assert 262_144 * 16.6 * 1024 / 1e9 == pytest.approx(4.46, abs=0.05)


def test_001_freed_ram_column_uses_nominal_128_gb():
    # 001 §8 table: "RAM freed vs 0.85": 0.5 -> ~45 GB, 0.4 -> ~58 GB
    assert round(freed_vs(0.5)) == 45
    assert round(freed_vs(0.4)) == 58


def test_001_table_row_0_4_matches_the_linear_model_and_row_0_5_does_not():
    # The 0.4 row (~23 GiB) follows from the 0.85 log; the 0.5 row (~39 GiB) does not (a linear
    # model gives ~34.6 GiB): a disagreement inside 001's table, reported, not hidden.
    p04 = plan_model("x", gpu_memory_utilization=0.4, weights_gib=21.94)
    p05 = plan_model("x", gpu_memory_utilization=0.5, weights_gib=21.94)
    assert p04.kv_pool_gib == pytest.approx(23, abs=0.6)
    assert p05.kv_pool_gib == pytest.approx(34.6, abs=0.6)


def test_002_host_total_from_055_reserving_65_8_gb():
    assert budget_gib(0.55) == pytest.approx(65.8, abs=0.05)
    assert HOST_MEMORY_GIB == pytest.approx(119.6)


def test_000_measured_pool_implies_79_kib_per_token_for_the_hybrid():
    # 000: "KV cache (fp8, 0.85 util) ~62 GiB / ~820K tokens": ~79 KiB per token, far above the
    # attention-only formula (10 KiB): Mamba state in align mode shares the pool.
    measured = 62 * GIB / 820_000
    assert measured / 1024 == pytest.approx(79.3, abs=0.2)
    assert kv_bytes_per_token(10, 2, 256, "fp8") == 10 * 1024


def test_kv_bytes_per_token_formula_and_dtypes():
    assert kv_bytes_per_token(80, 8, 128, "auto") == 2 * 80 * 8 * 128 * 2  # Llama-3.3-70B BF16
    assert kv_bytes_per_token(80, 8, 128, "fp8") == 2 * 80 * 8 * 128
    assert kv_bytes_per_token(80, 8, 128, "auto", tp=2) == 2 * 80 * 4 * 128 * 2
    assert kv_bytes_per_token(12, 2, 256, "bfloat16", tp=4) == 2 * 12 * 1 * 256 * 2  # heads replicated
    with pytest.raises(PlanError):
        kv_bytes_per_token(10, 2, 256, "int3")
    with pytest.raises(PlanError):
        kv_bytes_per_token(0, 2, 256)


def test_concurrency_and_budget_validate_inputs():
    with pytest.raises(PlanError):
        concurrency(100, 0)
    with pytest.raises(PlanError):
        budget_gib(1.2)
    with pytest.raises(PlanError):
        pool_tokens(10, 0)


def test_host_plan_002_sidecar_overcommit_errors_and_says_what_to_change():
    # 002 ran Qwen3.6 at 0.55 plus a Nemotron sidecar at 0.20 on Spark 1: fine;
    # an 0.85 model plus the 0.28 sidecar of Spark 2 is not.
    ok = plan_host([plan_model("qwen", gpu_memory_utilization=0.55, weights_gib=22),
                    plan_model("nano", gpu_memory_utilization=0.20, weights_gib=17)], host="spark1")
    assert ok.ok and ok.utilization_sum == pytest.approx(0.75)
    bad = plan_host([plan_model("gemma", gpu_memory_utilization=0.85, weights_gib=45),
                     plan_model("nano", gpu_memory_utilization=0.28, weights_gib=17)], host="spark2")
    assert not bad.ok
    text = str(bad.problems[0])
    assert "sum to 1.13" in text and "lower --gpu-memory-utilization of gemma from 0.85 to" in text


def test_host_plan_other_services_count():
    plan = plan_host([plan_model("m", gpu_memory_utilization=0.85, weights_gib=20)], other_services_gib=20)
    assert not plan.ok
    assert "other services take 20.0 GiB" in str(plan.problems[0])
    assert plan_host([plan_model("m", gpu_memory_utilization=0.85, weights_gib=20)]).ok


def test_host_plan_weights_larger_than_budget():
    plan = plan_host([plan_model("big", gpu_memory_utilization=0.5, weights_gib=70)])
    assert not plan.ok and "no room for a KV cache" in str(plan.problems[0])


def test_092_single_model_keeps_the_minimum_headroom():
    # 001 §7.2.3 and 003 run 0.92: 9.6 GiB stays free, above the 4 GiB floor
    plan = plan_host([plan_model("coder", gpu_memory_utilization=0.92, weights_gib=8.5)])
    assert plan.ok and plan.headroom_gib == pytest.approx(9.57, abs=0.05)


# ---- planner over catalog launches: measured figures, siblings, runtime quantization, G18 (issue 13)

from sparkprov.catalog.lint import ERROR, lint_launch, plan_launch  # noqa: E402
from sparkprov.catalog.load import load_catalog  # noqa: E402
from sparkprov.catalog.render import HostServeContext, render_launch  # noqa: E402

CAT = load_catalog()


def _plan(alias, overrides=None, ctx=None):
    r = CAT.get(alias)
    return plan_launch(render_launch(r, ctx or HostServeContext(), 1, overrides, catalog=CAT))


def test_000_measured_pool_is_used_as_logged():
    # 000 What Was Gained: "KV cache (fp8, 0.85 util) | ~62 GiB / ~820K tokens" (the formula said ~871K)
    plan = _plan("qwen3.5-35b-a3b-fp8")
    assert plan.kv_pool_gib == pytest.approx(62.0) and plan.pool_tokens == 820_000


def test_000_measured_pool_moves_with_utilization_gib_for_gib():
    plan = _plan("qwen3.5-35b-a3b-fp8", {"--gpu-memory-utilization": 0.80})
    assert plan.kv_pool_gib == pytest.approx(62.0 - 0.05 * HOST_MEMORY_GIB)
    assert plan.pool_tokens == pytest.approx(820_000 * plan.kv_pool_gib / 62.0, rel=1e-6)


def test_002_ngc_recipe_runs_131072_so_its_65536_figure_is_not_read_back():
    # 002's unit runs --max-model-len 131072, its prose says "65,536 context with this headroom gives
    # 1.6M token KV cache": a hybrid's tokens depend on --max-model-len, so the figure recorded at
    # 65,536 is not used for the launch at 131,072; the layers give 24.35 full-length requests, and
    # 24.35 x 65,536 is the note's 1.6M (docs/memory-planner.md, point K4)
    plan = _plan("qwen3.6-35b-a3b-ngc")
    assert plan.max_model_len == 131_072 and plan.pool_tokens != 1_600_000
    assert plan.concurrency * 65_536 == pytest.approx(1_600_000, rel=0.01)
    lower = _plan("qwen3.6-35b-a3b-ngc", {"--gpu-memory-utilization": 0.50})
    assert lower.pool_tokens < plan.pool_tokens


def test_002_runtime_fp8_weights_count_at_runtime_size():
    r = CAT.get("gemma-4-26b-a4b-fp8-mtp")  # a BF16 checkpoint quantized to FP8 at load time
    plan = _plan("gemma-4-26b-a4b-fp8-mtp")
    assert plan.weights_gib == pytest.approx(r.size_gb * 1e9 / GIB / 2)
    bf16 = _plan("gemma-4-26b-a4b-fp8-mtp", {"--quantization": None})
    assert bf16.weights_gib == pytest.approx(r.size_gb * 1e9 / GIB)


def test_G18_modeset0_cap_from_the_host_fails_a_higher_utilization():
    ctx = HostServeContext.from_host_vars("spark1", {"max_gpu_memory_utilization": 0.55}, home="/home/n")
    assert ctx.utilization_cap == 0.55
    launch = render_launch(CAT.get("qwen3.6-35b-a3b"), ctx, 1, catalog=CAT)  # util 0.85
    found = [f for f in lint_launch(launch, catalog=CAT) if f.rule == "G18"]
    assert len(found) == 1 and found[0].severity == ERROR and "lower --gpu-memory-utilization to 0.55" in found[0].fix
    ok = render_launch(CAT.get("qwen3.6-35b-a3b-ngc"), ctx, 1, catalog=CAT)  # 002's own 0.55
    assert [f for f in lint_launch(ok, catalog=CAT) if f.rule == "G18"] == []
    no_cap = render_launch(CAT.get("qwen3.6-35b-a3b"), HostServeContext(), 1, catalog=CAT)
    assert [f for f in lint_launch(no_cap, catalog=CAT) if f.rule == "G18"] == []


# ---- KV capacity from the layers' kinds (memory.kv_capacity, laid out as vLLM's v1 block pool)

from sparkprov.catalog.memory import AttentionLayers, KvShape, StateLayers, kv_capacity  # noqa: E402

LLAMA = KvShape((AttentionLayers(80, 8, 128),))  # config.json of Llama-3.3-70B
GPT_OSS = KvShape((AttentionLayers(18, 8, 64), AttentionLayers(18, 8, 64, window=128)))  # gpt-oss-120b
QWEN36 = KvShape((AttentionLayers(10, 2, 256),), (StateLayers(30, 8192, 4, 32 * 128 * 128, 4),))  # Qwen3.6-35B-A3B


def test_full_attention_only_holds_pool_over_the_formula_in_16_token_blocks():
    c = kv_capacity(LLAMA, 32.0, max_model_len=32_768)
    assert c.page_bytes == 16 * kv_bytes_per_token(1, 8, 128) and c.group_size == 80
    assert c.tokens == int(32 * GIB) // (16 * kv_bytes_per_token(80, 8, 128)) * 16
    two = kv_capacity(LLAMA, 32.0, max_model_len=32_768, tp=2)  # half the KV heads on each rank
    assert two.tokens == pytest.approx(2 * c.tokens, rel=1e-3)
    stage = kv_capacity(LLAMA, 32.0, max_model_len=32_768, pp=2)  # half the layers on each stage
    assert stage.tokens == pytest.approx(2 * c.tokens, rel=1e-3)


def test_sliding_window_layers_keep_the_window_not_the_sequence():
    # SlidingWindowSpec: cdiv(window - 1 + max_num_batched_tokens, block) + 1 blocks a request
    c = kv_capacity(GPT_OSS, 20.0, max_model_len=131_072, kv_dtype="fp8", max_num_batched_tokens=8192)
    assert c.blocks_per_request == 131_072 // 16 + (127 + 8192 + 15) // 16 + 1
    as_full = kv_capacity(KvShape((AttentionLayers(36, 8, 64),)), 20.0, max_model_len=131_072, kv_dtype="fp8")
    assert 1.8 < c.tokens / as_full.tokens < 2.0  # half the layers keep a bounded window


def test_state_layers_cost_a_page_per_group_per_request_whatever_its_length():
    short = kv_capacity(QWEN36, 40.0, max_model_len=8192, kv_dtype="fp8")
    long = kv_capacity(QWEN36, 40.0, max_model_len=262_144, kv_dtype="fp8")
    assert short.block_size == long.block_size == 2096 and short.group_size == 10
    state_blocks = 3 * 1  # three groups of 10 state layers, one state each ("none" mode)
    assert short.blocks_per_request == 8192 // 2096 + 1 + state_blocks
    assert long.blocks_per_request == -(-262_144 // 2096) + state_blocks
    # so a hybrid's tokens per GiB depend on --max-model-len: the state's share shrinks with it
    assert long.bytes_per_token(262_144) < 0.6 * short.bytes_per_token(8192)
    align = kv_capacity(QWEN36, 40.0, max_model_len=8192, kv_dtype="fp8", prefix_caching=True)
    assert align.blocks_per_request == short.blocks_per_request + 3  # "align" keeps two states a group
    spec = kv_capacity(QWEN36, 40.0, max_model_len=8192, kv_dtype="fp8", spec_tokens=2)
    assert spec.block_size == 2128 and spec.blocks_per_request == 8192 // 2128 + 1 + 3 * 3


def test_a_page_vllm_cannot_unify_is_refused():
    odd = KvShape((AttentionLayers(4, 3, 128), AttentionLayers(4, 2, 128, window=64)))
    with pytest.raises(PlanError, match="cannot unify"):
        kv_capacity(odd, 10.0, max_model_len=4096)
