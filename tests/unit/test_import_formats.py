"""`invoke recipe import` of NVIDIA's recipe catalog (schema 3) and of spark-pulse's bundled recipes
(`recipe_version: "2"` with params/engines): sparkprov/catalog/import_formats.py read through the
importer (sparkprov/catalog/importer.py), then linted with the G-rules.

The fixtures are real files, unchanged:
- tests/fixtures/nvidia-recipes/gemma-4-26b-a4b-dgx-spark-vllm-recipe.yaml: NVIDIA/local-ai-inference-recipes
  models/google/gemma-4-26b-a4b/dgx-spark/linux/vllm/recipe.yaml at 12b25c664d8bea9a819f6e6e33d59267dd7528df;
- tests/fixtures/nvidia-recipes/deepseek-v4-flash-dgx-spark-2gpu-vllm-recipe.yaml: the same repository,
  models/deepseek/deepseek-v4-flash/dgx-spark-2gpu/linux/vllm/recipe.yaml at the same commit;
- tests/fixtures/spark-pulse/qwen3.6-35b-a3b-fp8.yaml: kharkevich-engineering-lab/spark-pulse-recipes
  recipes/qwen3.6-35b-a3b-fp8.yaml at 57a493786278698911c95e5771979cca87dc7697.
"""

from pathlib import Path

import pytest
from invoke import Context, Exit

from sparkprov.catalog.import_formats import NVIDIA, SPARK_PULSE_V2, format_of
from sparkprov.catalog.importer import convert, import_file, lint_imported
from sparkprov.catalog.lint import errors
from sparkprov.cli.catalog import recipe_import
from sparkprov.errors import InputError
from sparkprov.serving.spec import recipe_container
from sparkprov.yamlpos import load_yaml

FIX = Path(__file__).parents[1] / "fixtures"
GEMMA = FIX / "nvidia-recipes" / "gemma-4-26b-a4b-dgx-spark-vllm-recipe.yaml"
DEEPSEEK = FIX / "nvidia-recipes" / "deepseek-v4-flash-dgx-spark-2gpu-vllm-recipe.yaml"
PULSE = FIX / "spark-pulse" / "qwen3.6-35b-a3b-fp8.yaml"


def imported(tmp_path, path, **kw):
    imp = import_file(path, **kw)
    launch, findings = lint_imported(imp.yaml_text(str(path)), imp.alias, tmp_path / f"{imp.alias}.yaml")
    return imp, launch, findings


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text))


def test_formats_are_told_apart():
    assert format_of(load_yaml(GEMMA)[0]) == NVIDIA and format_of(load_yaml(PULSE)[0]) == SPARK_PULSE_V2
    # sparkrun's recipe_version 2 (container/defaults) stays the importer's own
    assert format_of(load_yaml(FIX / "recipes-foreign" / "sparkrun-v2-qwen36-35b.yaml")[0]) is None


def test_nvidia_v3_single_spark_recipe_imports_and_lints(tmp_path):
    imp, launch, findings = imported(tmp_path, GEMMA)
    assert imp.fmt == NVIDIA and imp.alias == "gemma-4-26b-a4b-dgx-spark-vllm"
    assert launch.model_arg == "nvidia/Gemma-4-26B-A4B-NVFP4" and launch.image == "eugr/spark-vllm:nightly-20260704"
    assert launch.recipe.tp_sizes == [1] and launch.value("--max-model-len") == "262144"
    assert launch.speculative["model"] == "google/gemma-4-26B-A4B-it-assistant"
    assert launch.value("--port") == "8000"  # the house port (G31), not the recipe's
    assert any("draft_label google/gemma-4-26B-A4B-it-assistant" in p for p in imp.problems)
    assert any(p.startswith("runtime.setup_command") for p in imp.problems)
    # NVIDIA's recipe meets sparkprov's gotchas: an FP4 MoE without marlin, Gemma's MTP draft without fp8 KV
    assert {(f.rule, f.severity) for f in errors(findings)} == {("G7", "ERROR"), ("G29", "ERROR")}


def test_nvidia_v3_two_spark_recipe_drops_the_per_rank_options_and_lints_clean(tmp_path):
    imp, launch, findings = imported(tmp_path, DEEPSEEK)
    assert imp.fmt == NVIDIA and launch.recipe.tp_sizes == [2]
    assert errors(findings) == []
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"):
        assert not launch.has(flag), flag
    assert "$HEAD_IP" not in " ".join(recipe_container(launch).argv)
    assert launch.env_value("VLLM_USE_BREAKABLE_CUDAGRAPH") == "1"
    assert launch.env_value("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    assert any("--nnodes, --node-rank, --master-addr, --master-port" in p for p in imp.problems)
    assert any(p.startswith("serve.additional_commands worker") for p in imp.problems)


def test_spark_pulse_v2_params_and_engine_block_import_and_lint_clean(tmp_path):
    imp, launch, findings = imported(tmp_path, PULSE)
    assert imp.fmt == SPARK_PULSE_V2 and imp.alias == "qwen36-35b-a3b"
    assert launch.image == "vllm-node:latest" and launch.recipe.tp_sizes == [2]
    assert (launch.value("--max-model-len"), launch.value("--gpu-memory-utilization")) == ("262144", "0.8")
    assert launch.value("--tool-call-parser") == "qwen3_xml" and launch.has("--enable-prefix-caching")
    assert launch.env_value("VLLM_MARLIN_USE_ATOMIC_ADD") == "1"
    assert any(p.startswith("mods (mods/fix-qwen3.6-chat-template)") for p in imp.problems)
    assert errors(findings) == []


def test_spark_pulse_args_placeholders_take_the_params(tmp_path):
    doc = {"recipe_version": "2", "name": "p", "model": "org/m",
           "params": {"max_model_len": 4096, "served_model_name": "mine", "enforce_eager": True},
           "engines": {"vllm": {"image": "vllm/vllm-openai:v0.19.0", "args": ["--served-model-name", "{served_model_name}"]},
                       "sglang": {"image": "lmsysorg/sglang:spark"}}}
    imp = convert(doc, origin="p.yaml")
    assert {"--served-model-name": "mine"} in imp.recipe["args"] and {"--max-model-len": "4096"} in imp.recipe["args"]
    assert "--enforce-eager" in imp.recipe["args"]
    assert [a for a in imp.recipe["args"] if isinstance(a, dict) and "--served-model-name" in a] == [
        {"--served-model-name": "mine"}]  # args took it: not also added from params
    assert any(p.startswith("engines.sglang") for p in imp.problems)


def test_wrong_backend_and_missing_image_are_one_positioned_line(tmp_path):
    data, pos = load_yaml(GEMMA)
    with pytest.raises(InputError) as e:
        convert({**data, "backend": "llama-cpp"}, origin=str(GEMMA), pos=pos)
    assert str(e.value).startswith(f"{GEMMA}:{line_of(GEMMA, 'backend:')}:") and "vLLM only" in str(e.value)
    data, pos = load_yaml(PULSE)
    del data["engines"]["vllm"]["image"]
    with pytest.raises(InputError, match="names no container image for vLLM") as e:
        convert(data, origin=str(PULSE), pos=pos)
    assert str(e.value).startswith(f"{PULSE}:{pos.at(('engines', 'vllm'))[0]}:") and "under engines.vllm" in str(e.value)


def test_cli_imports_an_nvidia_recipe(tmp_path, capsys):
    out = tmp_path / "ds.yaml"
    recipe_import(Context(), str(DEEPSEEK), out=str(out))
    err = capsys.readouterr().err
    assert "(nvidia)" in err and "0 error(s)" in err and out.is_file()
    with pytest.raises(Exit) as e:  # lint errors: written to be edited, exit 1
        recipe_import(Context(), str(GEMMA), out=str(tmp_path / "g.yaml"))
    assert e.value.code == 1 and (tmp_path / "g.yaml").is_file()
