"""`invoke recipe import`: recipes of eugr/spark-vllm-docker and of sparkrun/spark-pulse
(recipe_version "2") become sparkprov user recipes, linted with the G-rules."""

from pathlib import Path

import pytest
import yaml
from invoke import Context, Exit

from sparkprov.catalog.importer import convert, detect_format, import_file, lint_imported
from sparkprov.catalog.lint import ERROR, errors
from sparkprov.cli.catalog import recipe, recipe_import

FIX = Path(__file__).parents[1] / "fixtures" / "recipes-foreign"


def imported(tmp_path, name, **kw):
    imp = import_file(FIX / name, **kw)
    out = tmp_path / f"{imp.alias}.yaml"
    out.write_text(imp.yaml_text(name))
    launch, findings = lint_imported(out, imp.alias)
    return imp, launch, findings


def test_formats_are_told_apart():
    assert detect_format(yaml.safe_load((FIX / "eugr-qwen36-27b.yaml").read_text())) == "eugr"
    assert detect_format(yaml.safe_load((FIX / "sparkrun-v2-qwen36-35b.yaml").read_text())) == "sparkrun-v2"
    with pytest.raises(ValueError, match="unknown recipe format"):
        detect_format({"recipe_version": "7", "model": "x"})
    with pytest.raises(ValueError, match="vLLM only"):
        convert({"recipe_version": "2", "model": "m/x", "runtime": "sglang", "container": "a/b:1"}, origin="x.yaml")


def test_eugr_recipe_imports_and_lints_clean(tmp_path):
    imp, launch, findings = imported(tmp_path, "eugr-qwen36-27b.yaml")
    assert imp.fmt == "eugr" and imp.problems == []
    assert [f.line() for f in findings if not f.silenced] == []
    assert launch.model_arg == "unsloth/Qwen3.6-27B-NVFP4" and launch.vllm_args[0].flag is None
    assert launch.value("--max-model-len") == "65536" and launch.value("--gpu-memory-utilization") == "0.85"
    assert launch.recipe.tp_sizes == [1] and launch.value("--port") == "8000"  # house port, from the host
    assert launch.recipe.source.note == "user" and "imported from a eugr recipe" in launch.recipe.source.quote


def test_sparkrun_v2_recipe_imports_and_lints_clean(tmp_path):
    imp, launch, findings = imported(tmp_path, "sparkrun-v2-qwen36-35b.yaml")
    assert imp.fmt == "sparkrun-v2"
    assert errors(findings) == [] and [f for f in findings if not f.silenced] == []
    assert launch.speculative == {"method": "mtp", "num_speculative_tokens": 2}
    assert launch.value("--moe-backend") == "marlin" and launch.has("--enable-prefix-caching")
    assert launch.env_value("VLLM_MARLIN_USE_ATOMIC_ADD") == "1"


def test_sparkrun_variant_applies_its_defaults(tmp_path):
    imp, launch, _ = imported(tmp_path, "sparkrun-v2-qwen36-35b.yaml", variant="long")
    assert imp.alias == "qwen36-35b-nvfp4-long"
    assert launch.value("--max-model-len") == "262144" and launch.value("--max-num-seqs") == "1"


def test_sparkrun_v2_without_command_builds_flags_from_defaults_and_finds_g7(tmp_path):
    imp, launch, findings = imported(tmp_path, "sparkrun-v2-nocommand.yaml")
    assert launch.has("--trust-remote-code") and launch.value("--quantization") == "modelopt"
    assert not launch.has("--enforce-eager")  # false: left out
    f = [x for x in findings if x.severity == ERROR]
    assert [x.rule for x in f] == ["G7"] and "add --moe-backend marlin" in f[0].fix


def test_eugr_recipe_with_problems_reports_each_one(tmp_path):
    imp, launch, findings = imported(tmp_path, "eugr-broken.yaml")
    text = "\n".join(imp.problems)
    assert "{max_model_len}" in text and "--api-key" in text and "mods (mods/fix-something)" in text
    assert "sk-not-a-real-key" not in imp.yaml_text("x") and "sk-not-a-real-key" not in " ".join(launch.argv)
    lines = [f.line() for f in findings if f.severity == ERROR]
    assert any(l.startswith("ERROR G4 gpt-oss-120b-upstream: --mxfp4-backend is not an option of the vLLM in "
                            "vllm/vllm-openai:v0.24.0 (vLLM 0.24.0") for l in lines)
    assert any("--speculative-disable-by-batch-size" in l and "disable_by_batch_size" in l for l in lines)
    assert any(l.startswith("ERROR G7") and "VLLM_MXFP4_USE_MARLIN=1" in l for l in lines)
    assert any(l.startswith("ERROR G1") for l in lines)  # an upstream release tag on GB10


def test_cli_recipe_import_writes_the_file_and_exits_by_errors(tmp_path, capsys):
    out = tmp_path / "mine.yaml"
    recipe(Context(), "import", file=str(FIX / "eugr-qwen36-27b.yaml"), out=str(out))
    assert out.is_file() and "alias: qwen3.6-27b-nvfp4" in out.read_text()
    assert "0 error(s)" in capsys.readouterr().err
    with pytest.raises(Exit) as e:
        recipe_import(Context(), str(FIX / "eugr-broken.yaml"), out=str(tmp_path / "b.yaml"))
    assert e.value.code == 1
    printed = capsys.readouterr().out
    assert "NOT IMPORTED gpt-oss-120b-upstream: --api-key" in printed and "ERROR G4" in printed
