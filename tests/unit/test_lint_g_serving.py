"""Lint rules G13-G35: memory, lifecycle, storage, serving flags, speculative decoding, multi-node;
and the catalog's own recipes stay quiet except for the documented disagreements."""

import textwrap

from sparkprov.catalog.lint import ERROR, WARNING, errors, lint_cluster, lint_launch, plan_launch
from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch
from helpers import one, user

CAT = load_catalog()
TP2 = dict(fabric_ifaces=["enp1s0f1np1"], ib_hcas=["rocep1s0f1"], node_ip="192.168.100.10", cluster_size=2)


def lint(alias, *, yaml=None, tmp_path=None, ctx=None, tp=None, rule=None, overrides=None, colocated=()):
    cat = CAT
    if yaml is not None:
        p = tmp_path / "user.yaml"
        p.write_text(textwrap.dedent(yaml))
        cat = load_catalog([p])
    r = cat.get(alias)
    ctx = ctx or HostServeContext()
    launch = render_launch(r, ctx, tp or min(r.tp_sizes), overrides, catalog=cat)
    others = [render_launch(cat.get(a), ctx, catalog=cat) for a in colocated]
    found = lint_launch(launch, catalog=cat, colocated=others)
    return [f for f in found if rule is None or f.rule == rule]


# ---------------------------------------------------------------- the catalog itself

DOCUMENTED = {  # alias -> rules that warn because two notes disagree (or a note documents the caveat)
    "gemma-4-26b-a4b-fp8-mtp": {"G27", "G29"},
    "gpt-oss-120b": {"G7"},
    "llama-3.3-70b": {"G35"},  # TP=2 through Ray on NGC 26.04, which ships no Ray (native would run)
    "nemotron-3-nano": {"G6", "G7"},
    # (its `pip install 'vllm[audio]'` is baked into a derived image, not run at start: no G24)
    "nemotron-3-nano-omni": {"G1", "G6", "G7"},
    "qwen3-coder-next": {"G9"},
    "qwen3.5-35b-a3b-fp8": {"G17", "G30"},
    "qwen3.6-27b-dflash": {"G29"},
    "qwen3.6-27b-mtp": {"G29"},
    "qwen3.6-35b-a3b": {"G10", "G29"},
    "qwen3.6-35b-a3b-dflash": {"G10", "G29"},
    "qwen3.6-35b-a3b-mtp": {"G29"},
    "qwen3.6-35b-a3b-ngc": {"G6", "G7"},
    # issue 13's seed variants: the caveats of their bases, and the ones their notes state
    # (qwen3.6-27b-yarn-1m: the 27B's linear-attention dimensions are not recorded, so no token
    # figure and no G17 claim about its 1M sequences: docs/memory-planner.md)
    "qwen3.6-35b-a3b-256k": {"G10", "G29"},
    "nemotron-3-nano-omni-ngc": {"G6", "G7"},
    "gpt-oss-120b-tp2": {"G7", "G34"},
    "qwen3.6-35b-a3b-heretic-dflash": {"G10"},  # chunked prefill inherited from the §7.1.1 recipe
}


def test_lint_catalog_recipes_have_no_errors_and_only_documented_warnings():
    for alias, r in CAT.recipes.items():
        tp = min(r.tp_sizes)
        ctx = HostServeContext(**TP2) if tp > 1 else HostServeContext()
        found = [f for f in lint(alias, ctx=ctx, tp=tp) if not f.silenced]
        assert errors(found) == [], [f.line() for f in found]
        assert {f.rule for f in found} == DOCUMENTED.get(alias, set()), (alias, [f.line() for f in found])
        for f in found:
            assert len(f.sources) >= 1 and "\n" not in f.line()


def test_lint_catalog_warnings_cite_two_sources_when_notes_disagree():
    for alias, rules in DOCUMENTED.items():
        for f in lint(alias):
            if f.rule in ("G6", "G7", "G9", "G10", "G27", "G30") and f.rule in rules:
                assert len(f.sources) >= 2, f.line()


# ---------------------------------------------------------------- G13 memory

def test_lint_g13_two_models_overcommit_one_host():
    f = one(lint("qwen3.6-35b-a3b", colocated=["nemotron-3-nano"], rule="G13"), ERROR)
    assert "sum to 1.70" in f.message and "lower --gpu-memory-utilization" in f.fix or "move" in f.fix


def test_lint_g13_other_services_count():
    f = one(lint("gemma-4-12b-coder", ctx=HostServeContext(other_services_gib=8), rule="G13"), ERROR)
    assert "other services take 8.0 GiB" in f.fix


def test_lint_g13_bad_utilization_value(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "add_args: [{--gpu-memory-utilization: 1.5}]\n"),
             tmp_path=tmp_path, rule="G13"), ERROR)


def test_lint_g13_silent_when_002_split_fits():
    # 002: Qwen3.6 at 0.55 plus a Nemotron sidecar at 0.20 on one Spark
    assert lint("qwen3.6-35b-a3b-ngc", colocated=[], rule="G13") == []
    found = lint("qwen3.6-35b-a3b-ngc", overrides=None, rule="G13",
                 colocated=[])
    assert found == []


def test_lint_g13_cpu_build_without_a_kv_cache_size_errors(tmp_path):
    """Measured on the real vLLM's CPU build (docs/real-vllm.md): without VLLM_CPU_KVCACHE_SPACE,
    --gpu-memory-utilization 0.85 claimed 85% of the host's RAM for the KV cache."""
    f = one(lint("broken", yaml=user("lab-tiny", "remove_env: [VLLM_CPU_KVCACHE_SPACE]\n"
                                     "add_args: [{--gpu-memory-utilization: 0.85}]\n"),
                 tmp_path=tmp_path, rule="G13"), ERROR)
    assert "CPU build" in f.message and "0.85" in f.message and "VLLM_CPU_KVCACHE_SPACE" in f.fix
    assert lint("lab-tiny", rule="G13") == []


def test_lint_g1_cpu_build_warns_and_lab_tiny_silences_it():
    (f,) = [f for f in lint("lab-tiny", rule="G1")]
    assert f.severity == WARNING and f.silenced and "CPU build" in f.message


def test_lint_g21_on_failure_restart_policy_warns(tmp_path):
    """The real API server exits 0 when its engine dies: on-failure leaves the model down."""
    f = one(lint("broken", yaml=user("qwen3.6-27b", "docker: {restart: on-failure}\n"), tmp_path=tmp_path,
                 rule="G21"), WARNING)
    assert "exits with status 0" in f.message and "unless-stopped" in f.fix
    assert lint("qwen3.6-27b", rule="G21") == []


# ---------------------------------------------------------------- G17 KV pool

def test_lint_g17_pool_smaller_than_one_request_errors(tmp_path):
    f = one(lint("broken", yaml=user("qwen3-coder-next", "add_args: [{--gpu-memory-utilization: 0.72}]\n"),
                 tmp_path=tmp_path, rule="G17"), ERROR)
    assert "less than one --max-model-len" in f.message


def test_lint_g17_too_few_full_length_sequences_warns(tmp_path):
    one(lint("broken", yaml=user("qwen3-coder-next", "add_args: [{--max-num-seqs: 16}]\n"), tmp_path=tmp_path,
             rule="G17"), WARNING)


def test_lint_g17_beyond_native_length_without_escape_hatch(tmp_path):
    f = one(errors(lint("broken", yaml=user("qwen3.6-27b", "add_args: [{--max-model-len: 1010000}]\n"),
                        tmp_path=tmp_path, rule="G17")), ERROR)
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in f.fix
    allowed = lint("broken", yaml=user("qwen3.6-27b", "add_args: [{--max-model-len: 1010000}]\n"
                                                      "env: {VLLM_ALLOW_LONG_MAX_MODEL_LEN: '1'}\n"),
                   tmp_path=tmp_path, rule="G17")
    assert not any("native" in f.message for f in allowed)


def test_lint_g17_silent_on_001_numbers_and_unknown_configs():
    assert lint("qwen3.6-35b-a3b", rule="G17") == []
    plan = plan_launch(render_launch(CAT.get("qwen3.6-35b-a3b"), HostServeContext(), catalog=CAT))
    assert abs(plan.pool_tokens - 4_843_965) < 60_000 and round(plan.concurrency) == 74
    assert lint("gemma-4-31b", rule="G17") == []  # no attention layout in the notes: no claim


# ---------------------------------------------------------------- G20, G22, G24, G26

def test_lint_g20_short_health_timeout_warns(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "startup: {health_timeout_s: 60}\n"), tmp_path=tmp_path,
             rule="G20"), WARNING)
    one(lint("broken", yaml=user("qwen3.5-122b", "startup: {health_timeout_s: 600}\n"), tmp_path=tmp_path,
             rule="G20"), WARNING)
    one(lint("broken", yaml=user("qwen3.6-27b", "startup: {warmup: false}\n"), tmp_path=tmp_path, rule="G20"), WARNING)


def test_lint_g20_silent_on_catalog_defaults():
    assert lint("qwen3.5-122b", rule="G20") == [] and lint("qwen3.6-27b", rule="G20") == []


def test_lint_g22_recipe_setting_hf_home_errors(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "env: {HF_HOME: /root/hf}\n"), tmp_path=tmp_path, rule="G22"), ERROR)
    assert lint("qwen3.6-27b", rule="G22") == []


def test_lint_g24_network_at_start_and_offline_override(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "env: {HF_HUB_OFFLINE: '0'}\n"), tmp_path=tmp_path, rule="G24"),
        WARNING)
    assert lint("qwen3.6-27b", rule="G24") == []


def test_lint_g26_gated_model_without_token_errors():
    f = one(lint("gemma-4-31b", ctx=HostServeContext(hf_token_available=False), rule="G26"), ERROR)
    assert "nvidia/Gemma-4-31B-IT-NVFP4 is gated" in f.message
    one(lint("gemma-4-26b-a4b-fp8-mtp", ctx=HostServeContext(hf_token_available=False), rule="G26"), ERROR)


def test_lint_g26_silent_with_token_unknown_or_ungated():
    assert lint("gemma-4-31b", ctx=HostServeContext(hf_token_available=True), rule="G26") == []
    assert lint("gemma-4-31b", rule="G26") == []
    assert lint("qwen3.6-27b", ctx=HostServeContext(hf_token_available=False), rule="G26") == []


# ---------------------------------------------------------------- G27-G31

def test_lint_g27_parser_without_auto_tool_choice_errors(tmp_path):
    f = one(lint("broken", yaml=user("qwen3-coder-next", "remove_args: [--enable-auto-tool-choice]\n"),
                 tmp_path=tmp_path, rule="G27"), ERROR)
    assert "HTTP 400" in f.message
    one(lint("broken", yaml=user("qwen3-coder-next", "remove_args: [--tool-call-parser]\n"), tmp_path=tmp_path,
             rule="G27"), ERROR)


def test_lint_g27_parser_of_another_family_warns(tmp_path):
    f = one(lint("broken", yaml=user("qwen3.6-35b-a3b", "add_args: [{--tool-call-parser: hermes}]\n"),
                 tmp_path=tmp_path, rule="G27"), WARNING)
    assert "qwen3_xml" in f.fix


def test_lint_g27_silent_on_matching_parsers():
    for alias in ("qwen3.6-35b-a3b", "qwen3.6-35b-a3b-ngc", "gemma-4-26b-a4b", "nemotron-3-nano", "qwen3.6-27b"):
        assert lint(alias, rule="G27") == []


def test_lint_g28_thinking_model_without_reasoning_parser_warns(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "remove_args: [--reasoning-parser]\n"), tmp_path=tmp_path,
             rule="G28"), WARNING)


def test_lint_g28_small_smoke_budget_with_thinking_warns():
    from sparkprov.catalog.models import SmokeSpec

    r = CAT.get("qwen3.6-27b").model_copy(update={"smoke": SmokeSpec(max_tokens=100)})
    found = [f for f in lint_launch(render_launch(r, HostServeContext(), catalog=CAT), catalog=CAT) if f.rule == "G28"]
    f = one(found, WARNING)
    assert "finish_reason length" in f.message


def test_lint_g28_silent_on_non_thinking_and_catalog():
    assert lint("qwen3-coder-next", rule="G28") == [] and lint("gemma-4-31b", rule="G28") == []
    assert lint("qwen3.6-35b-a3b", rule="G28") == []
    assert all(f.silenced for f in lint("qwen3.5-27b-dflash", rule="G28"))  # silenced with a reason


def test_lint_g29_dflash_with_fp8_kv_and_no_triton_errors(tmp_path):
    found = lint("broken", yaml=user("qwen3.6-35b-a3b-dflash", """
        remove_args: [--attention-backend]
        remove_env: [VLLM_USE_DEEP_GEMM]
        add_args: [{--kv-cache-dtype: fp8}]
    """), tmp_path=tmp_path, rule="G29")
    msgs = " | ".join(f.message for f in errors(found))
    assert "VLLM_USE_DEEP_GEMM=0" in msgs and "crash on GB10" in msgs and "must stay BF16" in msgs


def test_lint_g29_dflash_on_old_image_errors(tmp_path):
    found = errors(lint("broken", yaml=user("qwen3.6-35b-a3b-dflash", "image: nvcr.io/nvidia/vllm:26.04-py3\n"
                                                                       "command: full\n"),
                        tmp_path=tmp_path, rule="G29"))
    assert any("needs vLLM >= 0.21" in f.message for f in found)


def test_lint_g29_mtp_rules(tmp_path):
    f = one(lint("broken", yaml=user("qwen3.6-27b",
                                     "add_args: [{--speculative-config: {method: draft_model, model: x/y, num_speculative_tokens: 2}}]\n"),
                 tmp_path=tmp_path, rule="G29"), WARNING)
    assert "full model as drafter" in f.message
    one(lint("broken", yaml=user("gemma-4-12b-coder-mtp", "remove_args: [--kv-cache-dtype]\n"), tmp_path=tmp_path,
             rule="G29"), ERROR)
    one(lint("broken", yaml=user("qwen3.6-27b", "add_args: [{--speculative-config: {method: mtp, num_speculative_tokens: 5}}]\n"),
             tmp_path=tmp_path, rule="G29"), WARNING)


def test_lint_g29_silent_on_good_spec_configs():
    assert lint("gemma-4-12b-coder-mtp", rule="G29") == []
    assert lint("qwen3.5-27b-dflash", rule="G29") == []
    assert lint("laguna-xs.2-dflash", rule="G29") == []
    assert lint("qwen3.6-35b-a3b", overrides={"--speculative-config": {"method": "mtp", "num_speculative_tokens": 2,
                                                                       "moe_backend": "triton"}}, rule="G29") == []
    assert lint("qwen3.6-27b", rule="G29") == []


def test_lint_g30_fp8_kv_on_broken_model_errors(tmp_path):
    one(lint("broken", yaml=user("laguna-xs.2-dflash", "remove_args: [--speculative-config]\nadd_args: [{--kv-cache-dtype: fp8}]\n"),
             tmp_path=tmp_path, rule="G30"), ERROR)


def test_lint_g30_fp8_kv_on_qwen35_warns_citing_000_and_001():
    f = one(lint("qwen3.5-35b-a3b-fp8", rule="G30"), WARNING)
    assert f.sources[0].startswith("000") and f.sources[1].startswith("001")


def test_lint_g30_silent_on_models_built_for_fp8_kv():
    assert lint("nemotron-3-nano", rule="G30") == [] and lint("qwen3.6-35b-a3b", rule="G30") == []


def test_lint_g31_open_bind_without_key_errors():
    f = one(lint("qwen3.6-27b", ctx=HostServeContext(bind_host="0.0.0.0", api_key_file=None), rule="G31"), ERROR)
    assert "0.0.0.0:8000" in f.message


def test_lint_g31_key_in_recipe_env_errors(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "env: {VLLM_API_KEY: secret}\n"), tmp_path=tmp_path, rule="G31"),
        ERROR)


def test_lint_g31_silent_with_key_or_loopback():
    assert lint("qwen3.6-27b", rule="G31") == []
    assert lint("qwen3.6-27b", ctx=HostServeContext(bind_host="127.0.0.1", api_key_file=None), rule="G31") == []


# ---------------------------------------------------------------- multi-node

def test_lint_g32_tp2_without_fabric_errors():
    one(lint("llama-3.3-70b", ctx=HostServeContext(host_known=True, node_ip="192.168.100.10"), tp=2, rule="G32"), ERROR)
    assert lint("llama-3.3-70b", ctx=HostServeContext(host_known=True, **TP2), tp=2, rule="G32") == []


def test_lint_g32_silent_without_a_host():
    # `invoke lint ALIAS` with no --host knows nothing of the fabric: no finding either way.
    assert lint("llama-3.3-70b", ctx=HostServeContext(), tp=2, rule="G32") == []


def test_lint_g34_moving_tag_across_nodes_warns():
    one(lint("gpt-oss-120b", ctx=HostServeContext(**TP2), tp=2, rule="G34"), WARNING)
    assert lint("gpt-oss-120b", rule="G34") == []  # one node
    assert lint("llama-3.3-70b", ctx=HostServeContext(**TP2), tp=2, rule="G34") == []  # release tag


def test_lint_g34_cluster_nodes_must_match():
    a = render_launch(CAT.get("llama-3.3-70b"), HostServeContext(host="spark1", **TP2), 2, catalog=CAT)
    b = render_launch(CAT.get("llama-3.3-70b"), HostServeContext(host="spark2", **{**TP2, "node_ip": "192.168.100.11"}),
                      2, catalog=CAT)
    assert lint_cluster([a, b]) == []  # VLLM_HOST_IP differs per node: fine
    c = render_launch(CAT.get("llama-3.3-70b"), HostServeContext(host="spark2", model_store="/data", **TP2), 2,
                      catalog=CAT)
    found = lint_cluster([a, c])
    assert found and found[0].rule == "G34" and "model store differs" in found[0].message


def test_lint_g35_unsupported_tp_errors():
    f = one(lint("gemma-4-26b-a4b", ctx=HostServeContext(**TP2), tp=2, rule="G35"), ERROR)
    assert "not a size this recipe supports" in f.message and "001 §7.2.2" in f.sources[0]


def test_lint_g35_tp_must_equal_the_cluster_size():
    f = one(lint("gpt-oss-120b", ctx=HostServeContext(**{**TP2, "cluster_size": 3}), tp=2, rule="G35"), ERROR)
    assert "3 node(s)" in f.message


def test_lint_g35_silent_when_tp_matches():
    assert lint("gpt-oss-120b", ctx=HostServeContext(**TP2), tp=2, rule="G35") == []
    assert lint("qwen3.6-27b", rule="G35") == []


def test_lint_errors_cannot_be_silenced(tmp_path):
    found = lint("broken", yaml=user("qwen3.5-122b", """
        remove_args: [--moe-backend]
        lint_ignore: [{rule: G7, reason: "we know better than the notes"}]
    """), tmp_path=tmp_path, rule="G7")
    f = one(found, ERROR)
    assert f.silenced is None


def test_lint_output_is_one_line_per_finding():
    for f in lint("qwen3.6-35b-a3b"):
        line = f.line()
        assert "\n" not in line and line.startswith(f"{f.severity} {f.rule} qwen3.6-35b-a3b: ")
        assert "(fix: " in line and line.rstrip(")").endswith("]") or "(silenced" in line
