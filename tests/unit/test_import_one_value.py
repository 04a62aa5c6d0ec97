"""`invoke recipe import` (issue 33): a foreign value is one value, a key the format lacks is named,
a file is written only when the import has no error, and NVIDIA's recipe schema 4 imports beside
schema 3.

Real files among the fixtures (tests/fixtures/nvidia-recipes), unchanged:
- gemma-4-26b-a4b-dgx-spark-128gb-vllm-recipe-schema4.yaml: NVIDIA/local-ai-inference-recipes
  models/google/gemma-4-26b-a4b/dgx-spark/linux/vllm/128gb/recipe.yaml at dedcf6bc178c17d47eac559480ed8aebc26cfcc9
  (schema 4: spec_dec, min_vidmem_gb);
- minimax-m3-dgx-spark-4gpu-128gb-vllm-recipe-schema4.yaml: the same repository,
  models/minimax/minimax-m3/dgx-spark-4gpu/linux/vllm/128gb/recipe.yaml at the same commit (schema 4, the
  newer hardware id dgx-spark-4gpu: four Sparks);
- the schema 3 ones test_import_formats.py names.
The hostile recipes here are written for these tests, each beside what it exploited before.
"""

from pathlib import Path

import pytest
import yaml
from invoke import Context, Exit

from sparkprov.catalog.importer import import_file, lint_imported
from sparkprov.catalog.lint import errors
from sparkprov.cli.catalog import recipe_import
from sparkprov.data.inventory import load_inventory
from sparkprov.errors import InputError
from sparkprov.serving.deployment import load_serve_playbook

FIX = Path(__file__).parents[1] / "fixtures"
NV = FIX / "nvidia-recipes"
GEMMA4 = NV / "gemma-4-26b-a4b-dgx-spark-128gb-vllm-recipe-schema4.yaml"
MINIMAX4 = NV / "minimax-m3-dgx-spark-4gpu-128gb-vllm-recipe-schema4.yaml"
GEMMA3 = NV / "gemma-4-26b-a4b-dgx-spark-vllm-recipe.yaml"
PULSE = FIX / "spark-pulse" / "qwen3.6-35b-a3b-fp8.yaml"
SPARKRUN = FIX / "recipes-foreign" / "sparkrun-v2-qwen36-35b.yaml"

NVIDIA = """schema_version: 4
title: T
model: org/m
hardware: dgx-spark
platform: {{os: linux, execution: container}}
backend: vllm
checkpoint: {{target_label: org/model-7b}}
runtime: {{kind: container, image: "vllm/vllm-openai:v0.19.1"}}
serve:
  command: |
{command}
"""


def nvidia(tmp_path, *lines: str) -> Path:
    src = tmp_path / "recipe.yaml"
    src.write_text(NVIDIA.format(command="\n".join("    " + line for line in lines)), encoding="utf-8")
    return src


def refused(tmp_path, src: Path, **kw) -> str:
    """Through the command: exit 1, one printable line with the fix, nothing written."""
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(Exit) as err:
        recipe_import(Context(), str(src), out=str(tmp_path / "out.yaml"), **kw)
    msg = err.value.message
    assert err.value.code == 1 and msg and msg.isprintable() and len(msg.splitlines()) == 1, msg
    assert "(fix: " in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no file, no temporary left
    return msg.removeprefix("sparkprov: ")


def line_of(src: Path, text: str) -> int:
    return next(i for i, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1) if text in line)


# -- a line break inside a value splits it into two options ----------------------------------------


def test_a_line_separator_inside_an_nvidia_command_is_refused_at_its_line(tmp_path):
    """U+2028 ends a line for str.splitlines (and for an editor showing it as nothing): the flag after
    it was imported, unseen by a reader of the file, as --trust-remote-code."""
    src = tmp_path / "recipe.yaml"
    doc = yaml.safe_load(NVIDIA.format(command="    vllm serve org/model-7b"))
    doc["serve"]["command"] = "vllm serve org/model-7b --max-model-len 4096\u2028--trust-remote-code\n"
    src.write_text(yaml.safe_dump(doc, allow_unicode=False), encoding="utf-8")
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, 'command:')}:") and "line break other than \\n (\\u2028)" in msg


@pytest.mark.parametrize("brk", ["\r", "\x0b", "\x0c", "\x85", "\u2029"])
def test_every_other_line_break_in_a_command_is_refused(tmp_path, brk):
    src = tmp_path / "recipe.yaml"
    doc = yaml.safe_load(NVIDIA.format(command="    vllm serve org/model-7b"))
    doc["serve"]["command"] = f"vllm serve org/model-7b --max-num-seqs 4{brk}--trust-remote-code\n"
    src.write_text(yaml.safe_dump(doc), encoding="utf-8")
    assert "holds a line break other than \\n" in refused(tmp_path, src)


def test_a_line_break_in_a_spark_pulse_param_used_in_args_is_refused_at_the_param(tmp_path):
    """`{served}` in args filled with "x\\n--trust-remote-code" became two words: a smuggled flag."""
    doc = {"recipe_version": "2", "name": "p", "model": "org/model-7b",
           "params": {"served": "x\n--trust-remote-code"},
           "engines": {"vllm": {"image": "vllm/vllm-openai:v0.19.0", "args": "--served-model-name {served}"}}}
    src = tmp_path / "pulse.yaml"
    src.write_text(yaml.safe_dump(doc), encoding="utf-8")
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, 'served:')}:") and "defaults served" in msg
    assert "holds a line break (\\n)" in msg


def test_an_eugr_template_value_stays_one_value(tmp_path):
    """eugr's `command` template filled a defaults value in before the words were split: a value with
    a line break smuggled a flag (refused now, at its line); a value with a space stays one word."""
    base = {"recipe_version": "1", "name": "e", "model": "org/model-7b", "container": "vllm/vllm-openai:v0.19.0",
            "command": "vllm serve {model} --served-model-name {name}"}
    src = tmp_path / "eugr.yaml"
    src.write_text(yaml.safe_dump({**base, "defaults": {"name": "x\n--trust-remote-code"}}), encoding="utf-8")
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, 'name: ')}:") and "defaults name" in msg
    src.write_text(yaml.safe_dump({**base, "defaults": {"name": "x --trust-remote-code"}}), encoding="utf-8")
    args = import_file(src).recipe["args"]
    assert args == [{"--served-model-name": "x --trust-remote-code"}]  # one value, no flag of its own


# -- a shell expansion would reach vLLM as its characters --------------------------------------------


@pytest.mark.parametrize("line,needle", [
    ("export OMP_NUM_THREADS=$(nproc)", "$(nproc)"),
    ("export PATH=$PATH:/opt/x/bin", "$PATH"),
    ("export CUDA_HOME=${CUDA_HOME}", "${CUDA_HOME}"),
    ("export ARCH=`uname -m`", "`uname -m`"),
])
def test_a_shell_expansion_in_an_nvidia_export_is_refused_at_its_line(tmp_path, line, needle):
    src = nvidia(tmp_path, line, "vllm serve org/model-7b --max-num-seqs 4")
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, line)}: export ") and f"shell expansion {needle!r}" in msg, msg


def test_a_shell_expansion_in_a_kept_option_is_refused_and_in_a_dropped_rank_option_is_not(tmp_path):
    src = nvidia(tmp_path, "vllm serve org/model-7b \\", "  --max-num-seqs $(nproc) \\", "  --enable-prefix-caching")
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, '$(nproc)')}: the command:") and "'$(nproc)'" in msg
    # the per-node placeholders of the options sparkprov sets itself are dropped, not refused
    ok = nvidia(tmp_path, "vllm serve org/model-7b --nnodes 2 --node-rank 0 --master-addr \"$HEAD_IP\" \\",
                "  --tensor-parallel-size 2")
    imp = import_file(ok)
    assert imp.recipe["tp_sizes"] == [2] and any("--master-addr" in p for p in imp.problems)


def test_the_real_schema3_export_with_a_comment_keeps_the_value(tmp_path):
    """`export X="0" # why` exports 0: the comment was kept as part of the value."""
    src = nvidia(tmp_path, 'export VLLM_MOE_SKIP_PADDING="0" # 8/17 - need this', "vllm serve org/model-7b")
    assert import_file(src).recipe["env"] == {"VLLM_MOE_SKIP_PADDING": "0"}


def test_a_shell_expansion_in_an_eugr_command_or_value_is_refused(tmp_path):
    base = {"recipe_version": "1", "name": "e", "model": "org/model-7b", "container": "vllm/vllm-openai:v0.19.0"}
    src = tmp_path / "eugr.yaml"
    src.write_text(yaml.safe_dump({**base, "command": "vllm serve {model} --download-dir $HOME/models"}))
    assert "shell expansion '$HOME'" in refused(tmp_path, src)
    src.write_text(yaml.safe_dump({**base, "command": "vllm serve {model}", "env": {"PATH": "$PATH:/x"}}))
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, 'PATH: ')}:") and "env PATH" in msg


# -- keys the format lacks; a file only without an error ---------------------------------------------


def test_a_misspelled_top_level_key_is_named_with_the_keys_there_are(tmp_path):
    """sparkrun's `defualts:` was dropped silently, and the tensor-parallel placeholder it held left
    unfilled: a misleading error about the size instead of the key."""
    doc = yaml.safe_load(SPARKRUN.read_text())
    doc["defualts"] = doc.pop("defaults")
    src = tmp_path / "sparkrun.yaml"
    src.write_text(yaml.safe_dump(doc, sort_keys=False))
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, 'defualts:')}:1: 'defualts' is not a key of a sparkrun recipe")
    assert "did you mean 'defaults'?" in msg
    doc = yaml.safe_load(GEMMA3.read_text())
    doc["servve"] = doc.pop("serve")
    src.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert "'servve' is not a key of an NVIDIA recipe" in refused(tmp_path, src)
    pulse = yaml.safe_load(PULSE.read_text())
    pulse["engins"] = pulse.pop("engines")
    src.write_text(yaml.safe_dump(pulse, sort_keys=False))
    assert "'engins' is not a key of a spark-pulse recipe" in refused(tmp_path, src)


def test_a_spark_pulse_params_key_that_is_no_option_is_refused_and_nothing_written(tmp_path):
    """It was a NOT IMPORTED line while the file was still written; the same key in sparkrun's
    defaults was refused at its line."""
    pulse = yaml.safe_load(PULSE.read_text())
    pulse["params"]["max_model_len;touch x"] = 1
    src = tmp_path / "pulse.yaml"
    src.write_text(yaml.safe_dump(pulse, sort_keys=False))
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, 'max_model_len;touch x')}:") and "does not name an option" in msg


@pytest.mark.parametrize("command,words", [
    ("vllm serve org/model-7b --max-model-len 4096 8192", "the word '8192'"),
    ("vllm serve org/model-7b -x 1", "short option '-x'"),
    ("vllm serve org/model-7b '--a;b'", "'--a;b' is not a long option"),
])
def test_a_command_that_is_no_vllm_serve_command_line_is_an_error_not_a_note(tmp_path, command, words):
    src = tmp_path / "eugr.yaml"
    src.write_text(yaml.safe_dump({"recipe_version": "1", "model": "org/model-7b", "command": command,
                                   "container": "vllm/vllm-openai:v0.19.0"}))
    assert words in refused(tmp_path, src)


# -- NVIDIA's schema 4 beside schema 3 -----------------------------------------------------------------


def test_nvidia_schema4_single_spark_recipe_imports_as_its_schema3_twin(tmp_path):
    imp = import_file(GEMMA4)
    launch, findings = lint_imported(imp.yaml_text(str(GEMMA4)), imp.alias, tmp_path / "g.yaml")
    assert imp.fmt == "nvidia" and launch.recipe.tp_sizes == [1]
    assert launch.model_arg == "nvidia/Gemma-4-26B-A4B-NVFP4" and launch.image == "eugr/spark-vllm:nightly-20260704"
    assert launch.speculative["method"] == "mtp" and launch.value("--max-model-len") == "262144"
    twin = import_file(GEMMA3)  # schema 3: the same model, image and command
    assert imp.recipe["args"] == twin.recipe["args"] and imp.recipe["image"] == twin.recipe["image"]
    assert {(f.rule, f.severity) for f in errors(findings)} == {("G7", "ERROR"), ("G29", "ERROR")}


def test_nvidia_schema4_four_spark_recipe_imports_at_tp_4(tmp_path):
    imp = import_file(MINIMAX4)
    launch, findings = lint_imported(imp.yaml_text(str(MINIMAX4)), imp.alias, tmp_path / "m.yaml")
    assert launch.recipe.tp_sizes == [4] and launch.model_arg == "nvidia/MiniMax-M3-NVFP4"
    assert launch.speculative["method"] == "eagle3"
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port"):
        assert not launch.has(flag), flag
    assert any(p.startswith("checkpoint.draft_label Inferact/MiniMax-M3-EAGLE3") for p in imp.problems)


@pytest.mark.parametrize("change,at,words", [
    ({"hardware": "dgx-station-2gpu"}, "hardware:", "hardware 'dgx-station-2gpu': sparkprov serves DGX Spark"),
    ({"hardware": "rtx-spark"}, "hardware:", "hardware 'rtx-spark'"),
    ({"min_vidmem_gb": 256}, "min_vidmem_gb:", "min_vidmem_gb 256: a DGX Spark has 128 GB"),
    ({"schema_version": 5}, "schema_version:", "schemas 3 and 4"),
    ({"hardware": "dgx-spark-2gpu"}, "node_count:", "topology.node_count 4 but hardware dgx-spark-2gpu is 2"),
])
def test_nvidia_schema4_hardware_memory_and_schema_are_checked(tmp_path, change, at, words):
    doc = yaml.safe_load(MINIMAX4.read_text())
    doc.update(change)
    src = tmp_path / "recipe.yaml"
    src.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    msg = refused(tmp_path, src)
    assert msg.startswith(f"{src}:{line_of(src, at)}:") and words in msg, msg


# -- serve playbooks -----------------------------------------------------------------------------------

INVENTORY = "hosts:\n  s1: {address: 127.0.0.1}\n  s2: {address: 127.0.0.1}\n"


@pytest.mark.parametrize("text,line,words", [
    # the catalog named the folder, not the playbook's line
    ("recipes: [.]\ndeployments:\n  - {name: a, model: lab-tiny, hosts: [s1]}\n", 1, "'.' is not a file"),
    # [s1, s1] resolved to one host: a TP 2 deployment with rank 0 only
    ("deployments:\n  - name: a\n    model: lab-tiny\n    tp: 2\n    hosts: [s1, s1]\n", 5, "hosts name 's1' twice"),
])
def test_a_serve_playbook_is_refused_at_its_line(tmp_path, text, line, words):
    (tmp_path / "inv.yaml").write_text(INVENTORY)
    book = tmp_path / "serve.yaml"
    book.write_text(text)
    with pytest.raises(InputError) as err:
        load_serve_playbook(book, load_inventory(tmp_path / "inv.yaml"))
    assert err.value.line().startswith(f"{book}:{line}:") and words in err.value.line()
