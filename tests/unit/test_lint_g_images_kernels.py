"""Lint rules G1-G12: images, entrypoints, quantization, kernels, hybrid models.
Each rule fires on a deliberately broken user recipe and stays silent where it must."""

import textwrap


from sparkprov.catalog.lint import ERROR, RULES, WARNING, lint_launch
from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch
from sparkprov.serving.spec import recipe_container
from helpers import one, user

CAT = load_catalog()


def lint(alias, *, yaml=None, tmp_path=None, ctx=None, tp=None, rule=None, overrides=None):
    cat = CAT
    if yaml is not None:
        p = tmp_path / "user.yaml"
        p.write_text(textwrap.dedent(yaml))
        cat = load_catalog([p])
    r = cat.get(alias)
    launch = render_launch(r, ctx or HostServeContext(), tp or min(r.tp_sizes), overrides, catalog=cat)
    found = lint_launch(launch, catalog=cat)
    return [f for f in found if rule is None or f.rule == rule]


def test_lint_rules_cover_the_launch_gotchas():
    need = {f"G{n}" for n in (1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 17, 20, 26, 27, 28, 29, 30, 31, 34, 35)}
    assert need <= set(RULES)
    for r in RULES.values():
        assert r.sources and r.title and r.severity in (ERROR, WARNING)


# G1
def test_lint_g1_stable_upstream_image_errors(tmp_path):
    f = one(lint("broken", yaml=user("qwen3.6-27b", "image: vllm/vllm-openai:latest\n"), tmp_path=tmp_path,
                 rule="G1"), ERROR)
    assert "does not run on GB10" in f.message and "cu130-nightly" in f.fix
    one(lint("broken", yaml=user("qwen3.6-27b", "image: vllm/vllm-openai:v0.11.0\n"), tmp_path=tmp_path,
             rule="G1"), ERROR)


def test_lint_g1_unknown_image_warns_and_known_images_are_silent(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "image: example.org/my/vllm:1\n"), tmp_path=tmp_path, rule="G1"),
        WARNING)
    assert lint("qwen3.6-27b", rule="G1") == []
    assert lint("nemotron-3-nano", rule="G1") == []
    assert lint("broken", yaml=user("qwen3.6-27b", "image: vllm/vllm-openai:cu130-nightly-2026-07\n"),
                tmp_path=tmp_path, rule="G1") == []


def test_lint_g1_validated_stable_tag_warns_citing_both():
    f = one(lint("nemotron-3-nano-omni", rule="G1"), WARNING)
    assert f.sources == ("001 §2", "001 §7.3.2")


# G2
def test_lint_g2_vllm_serve_twice_on_upstream_image(tmp_path):
    no_key = HostServeContext(bind_host="127.0.0.1", api_key_file=None)  # no wrapper: the image's entrypoint runs
    f = one(lint("broken", yaml=user("qwen3.6-27b", "command: full\n"), tmp_path=tmp_path, ctx=no_key, rule="G2"),
            ERROR)
    assert "unrecognized arguments: serve" in f.message


def test_lint_G2_no_false_error_under_the_api_key_wrapper(tmp_path):
    # the wrapper replaces the entrypoint with sh and execs `vllm serve` once: `command: full` is harmless
    cat_yaml = user("qwen3.6-27b", "command: full\n")
    assert lint("broken", yaml=cat_yaml, tmp_path=tmp_path, rule="G2") == []
    p = tmp_path / "user.yaml"
    cat = load_catalog([p])
    launch = render_launch(cat.get("broken"), HostServeContext(), 1, catalog=cat)
    assert launch.wrapped and recipe_container(launch).argv.count("serve") == 1


def test_lint_g2_bare_on_ngc_image(tmp_path):
    one(lint("broken", yaml=user("nemotron-3-nano", "command: bare\n"), tmp_path=tmp_path, rule="G2"), ERROR)


def test_lint_g2_silent_when_style_matches():
    for alias in ("qwen3.6-27b", "nemotron-3-nano", "gpt-oss-120b", "nemotron-3-nano-omni"):
        assert lint(alias, rule="G2") == []


# G3
def test_lint_g3_bare_gemma4_tag_errors(tmp_path):
    f = one(lint("broken", yaml=user("gemma-4-31b", "image: vllm/vllm-openai:gemma4\n"), tmp_path=tmp_path,
                 rule="G3"), ERROR)
    assert "FP4 gemm Runner" in f.message and f.fix == "use vllm/vllm-openai:gemma4-cu130"
    assert lint("broken", yaml=user("gemma-4-31b", "image: vllm/vllm-openai:gemma4\n"), tmp_path=tmp_path,
                rule="G1") == []  # G3 owns it: one finding, not two


def test_lint_g3_silent_on_cu130_gemma_images():
    assert lint("gemma-4-31b", rule="G3") == []
    assert lint("gemma-4-26b-a4b-fp8-mtp", rule="G3") == []


# G5
def test_lint_g5_old_driver_warns_for_25_12_image():
    f = one(lint("nemotron-3-nano", ctx=HostServeContext(driver_version="580.95.05"), rule="G5"), WARNING)
    assert "590.44" in f.message and "UNAVAILABLE" in f.message


def test_lint_g5_silent_with_new_or_unknown_driver_or_other_images():
    assert lint("nemotron-3-nano", ctx=HostServeContext(driver_version="590.48.01"), rule="G5") == []
    assert lint("nemotron-3-nano", rule="G5") == []
    assert lint("qwen3.6-27b", ctx=HostServeContext(driver_version="580.95.05"), rule="G5") == []


# G6
def test_lint_g6_modelopt_on_compressed_tensors_errors(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "add_args: [{--quantization: modelopt}]\n"), tmp_path=tmp_path,
             rule="G6"), ERROR)


def test_lint_g6_wrong_flag_on_modelopt_errors(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-35b-a3b", "add_args: [{--quantization: compressed-tensors}]\n"),
             tmp_path=tmp_path, rule="G6"), ERROR)


def test_lint_g6_explicit_compressed_tensors_warns_citing_001_and_002():
    f = one(lint("qwen3.6-35b-a3b-ngc", rule="G6"), WARNING)
    assert f.sources == ("001 §6 Important", "002")


def test_lint_g6_silent_on_correct_flags():
    assert lint("qwen3.6-35b-a3b", rule="G6") == []
    assert lint("qwen3.6-27b", rule="G6") == []
    assert lint("gemma-4-26b-a4b-fp8-mtp", rule="G6") == []


# G7
def test_lint_g7_fp4_moe_without_marlin_on_nightly_errors(tmp_path):
    f = one(lint("broken", yaml=user("qwen3.5-122b", "remove_args: [--moe-backend]\n"), tmp_path=tmp_path,
                 rule="G7"), ERROR)
    assert f.line().startswith("ERROR G7 broken: FP4 MoE on sm_121 needs --moe-backend marlin")
    assert "(fix: add --moe-backend marlin)" in f.line() and f.line().endswith("[001 §6 Caution; 001 §7.2.2]")


def test_lint_g7_legacy_env_on_023_is_ignored(tmp_path):
    found = lint("broken", yaml=user("qwen3.5-122b", "env: {VLLM_USE_FLASHINFER_MOE_FP4: '1'}\n"),
                 tmp_path=tmp_path, rule="G7")
    f = one(found, WARNING)
    assert "Unknown vLLM environment variable" in f.message


def test_lint_g7_mxfp4_needs_marlin(tmp_path):
    one(lint("broken", yaml=user("gpt-oss-120b", "remove_args: [--mxfp4-backend]\n"), tmp_path=tmp_path,
             rule="G7"), ERROR)
    assert lint("broken", yaml=user("gpt-oss-120b", "remove_args: [--mxfp4-backend]\nenv: {VLLM_MXFP4_USE_MARLIN: '1'}\n"),
                tmp_path=tmp_path, rule="G7") == []


def test_lint_g7_fix_names_the_variable_vllm_reads(tmp_path):
    # 001 writes VLLM_MXFP4_BACKEND=marlin; vLLM only knows VLLM_MXFP4_USE_MARLIN.
    found = lint("broken", yaml=user("gpt-oss-120b", "remove_args: [--mxfp4-backend]\nenv: {VLLM_MXFP4_BACKEND: marlin}\n"),
                 tmp_path=tmp_path, rule="G7")
    assert len(found) == 2 and all(f.severity == ERROR for f in found)
    assert any("VLLM_MXFP4_BACKEND (001's spelling) is not a vLLM variable" in f.message for f in found)
    assert all("VLLM_MXFP4_USE_MARLIN=1" in f.fix for f in found)


def test_lint_g7_documented_disagreements_warn():
    for alias in ("nemotron-3-nano", "qwen3.6-35b-a3b-ngc", "gpt-oss-120b"):
        one(lint(alias, rule="G7"), WARNING)


def test_lint_g7_silent_with_marlin_or_dense_or_fp8():
    for alias in ("qwen3.5-122b", "gemma-4-26b-a4b", "gemma-4-31b", "qwen3-coder-next", "qwen3.6-35b-a3b"):
        assert lint(alias, rule="G7") == []


def test_lint_g7_not_a_vllm_variable_warns(tmp_path):
    # 003's VLLM_USE_FLASHINFER_MOE is dropped by a documented correction; a user adding it back is warned
    assert lint("qwen3-next-80b-gptq", rule="G7") == []
    f = one(lint("broken", yaml=user("qwen3-next-80b-gptq", "env: {VLLM_USE_FLASHINFER_MOE: '0'}\n"),
                 tmp_path=tmp_path, rule="G7"), WARNING)
    assert "not a vLLM variable" in f.message


# G8
def test_lint_g8_fp4_smoke_without_expected_answer_warns(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-27b", "smoke: {expect: null}\n"), tmp_path=tmp_path, rule="G8"), WARNING)
    one(lint("broken", yaml=user("qwen3.6-27b", "smoke: {reject_degenerate: false}\n"), tmp_path=tmp_path,
             rule="G8"), WARNING)


def test_lint_g8_silent_on_catalog_and_non_fp4(tmp_path):
    assert lint("qwen3.6-27b", rule="G8") == []
    assert lint("broken", yaml=user("qwen3-coder-next", "smoke: {expect: null}\n"), tmp_path=tmp_path, rule="G8") == []


# G9
def test_lint_g9_flashinfer_on_mamba_hybrid_errors(tmp_path):
    f = one(lint("broken", yaml=user("qwen3.6-35b-a3b", "add_args: [{--attention-backend: flashinfer}]\n"),
                 tmp_path=tmp_path, rule="G9"), ERROR)
    assert "init_device" in f.message


def test_lint_g9_gated_deltanet_only_warns_citing_both_sections():
    f = one(lint("qwen3-coder-next", rule="G9"), WARNING)
    assert f.sources == ("001 §7.1.1", "001 §7.1.3")


def test_lint_g9_silent_on_dense_and_on_triton():
    assert lint("gpt-oss-120b", rule="G9") == []  # FLASHINFER on a non-hybrid
    assert lint("qwen3.6-35b-a3b-dflash", rule="G9") == []


# G10
def test_lint_g10_chunked_prefill_on_hybrid_warns_with_both_sources(tmp_path):
    f = one(lint("broken", yaml=user("qwen3.5-122b", "add_args: [--enable-chunked-prefill]\n"), tmp_path=tmp_path,
                 rule="G10"), WARNING)
    assert f.sources == ("000 Gotcha 5", "001 §7.1.1")
    one(lint("qwen3.6-35b-a3b", rule="G10"), WARNING)  # the documented disagreement


def test_lint_g10_silent_without_the_flag_or_on_dense():
    assert lint("qwen3.5-122b", rule="G10") == []
    assert lint("gemma-4-31b", overrides={"--enable-chunked-prefill": True}, rule="G10") == []


def test_lint_g10_can_be_silenced_with_a_reason(tmp_path):
    found = lint("broken", yaml=user("qwen3.6-35b-a3b", """
        lint_ignore:
          - {rule: G10, reason: "measured: no regression on our build"}
    """), tmp_path=tmp_path, rule="G10")
    assert found[0].silenced == "measured: no regression on our build"
    assert found[0].line().endswith("(silenced: measured: no regression on our build)")


# G11
def test_lint_g11_prefix_caching_on_hybrid_without_batched_tokens_errors(tmp_path):
    f = one(lint("broken", yaml=user("qwen3.5-35b-a3b-fp8", "remove_args: [--max-num-batched-tokens]\n"),
                 tmp_path=tmp_path, rule="G11"), ERROR)
    assert "2048" in f.message and "2096" in f.message


def test_lint_g11_batched_tokens_below_block_size_errors(tmp_path):
    one(lint("broken", yaml=user("qwen3.6-35b-a3b", "add_args: [{--max-num-batched-tokens: 2048}]\n"),
             tmp_path=tmp_path, rule="G11"), ERROR)


def test_lint_g11_silent_when_large_enough_or_no_prefix_caching():
    for alias in ("qwen3.6-35b-a3b", "qwen3.5-35b-a3b-fp8", "qwen3-coder-next", "nemotron-3-nano-omni",
                  "qwen3.6-35b-a3b-ngc", "qwen3.6-27b", "nemotron-3-nano"):
        assert lint(alias, rule="G11") == []
    assert lint("gpt-oss-120b", overrides={"--max-num-batched-tokens": None}, rule="G11") == []  # not hybrid


# G12
def test_lint_g12_coder_next_without_prefix_caching_warns(tmp_path):
    one(lint("broken", yaml=user("qwen3-coder-next", "remove_args: [--enable-prefix-caching]\n"), tmp_path=tmp_path,
             rule="G12"), WARNING)


def test_lint_g12_silent_when_enabled_or_not_an_agent(tmp_path):
    assert lint("qwen3-coder-next", rule="G12") == []
    assert lint("broken", yaml=user("qwen3-coder-next",
                                    "remove_args: [--enable-prefix-caching, --tool-call-parser, --enable-auto-tool-choice]\n"),
                tmp_path=tmp_path, rule="G12") == []
