"""`invoke models`, `invoke recipe`, `invoke lint`: thin tasks over the catalog."""

import json
import textwrap

import pytest
from invoke import Context, Exit

from sparkprov.cli import catalog as cli


def test_catalog_cli_models_plain_lists_every_alias(capsys):
    cli.models(Context(), plain=True)
    rows = [l.split("\t") for l in capsys.readouterr().out.splitlines()]
    aliases = {r[0] for r in rows}
    assert {"qwen3.6-35b-a3b", "llama-3.3-70b", "gpt-oss-120b"} <= aliases
    row = next(r for r in rows if r[0] == "qwen3.5-122b")
    assert row[1] == "RedHatAI/Qwen3.5-122B-A10B-NVFP4" and row[2] == "75.6 GB" and row[4] == "1"


def test_catalog_cli_recipe_prints_command_and_sources(capsys):
    cli.recipe(Context(), "nemotron-3-nano")
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("docker run -d --name sparkprov-nemotron-3-nano ")
    assert "001 §7.3.1" in out and "memory: nemotron-3-nano" in out


def test_catalog_cli_recipe_argv_json_for_a_host(tmp_path, capsys):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(textwrap.dedent("""
        hosts:
          spark1:
            address: 10.77.0.11
            vars: {model_store: /data/models, serve_port: 8100, fabric_ifaces: [enp1s0f1np1], fabric_ip: 192.168.100.11}
    """))
    cli.recipe(Context(), "gpt-oss-120b", tp=2, host="spark1", inventory=str(inv), argv=True)
    argv = json.loads(capsys.readouterr().out)
    assert "NCCL_SOCKET_IFNAME=enp1s0f1np1" in argv and "VLLM_HOST_IP=192.168.100.11" in argv
    assert "/data/models:/data/models" in argv and argv[argv.index("--port") + 1] == "8100"


def test_catalog_cli_lint_exits_nonzero_on_errors(tmp_path, capsys):
    p = tmp_path / "mine.yaml"
    p.write_text("recipes:\n  - alias: broken\n    extends: qwen3.5-122b\n    remove_args: [--moe-backend]\n")
    with pytest.raises(Exit) as e:
        cli.lint(Context(), "broken", recipes=[str(p)])
    assert e.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["ERROR G7 broken: FP4 MoE on sm_121 needs --moe-backend marlin: no native FP4 MoE kernel, "
                     "CUTLASS FP4 emits garbage or fails (fix: add --moe-backend marlin) [001 §6 Caution; 001 §7.2.2]"]


def test_catalog_cli_lint_all_catalog_has_no_errors(capsys):
    cli.lint(Context(), "qwen3.6-27b")
    cli.lint(Context(), "qwen3.5-122b")
    captured = capsys.readouterr()
    assert captured.out == "" and "0 error(s), 0 warning(s)" in captured.err


def test_catalog_cli_unknown_alias_is_one_line():
    with pytest.raises(Exit) as e:
        cli.recipe(Context(), "qwen3.6-3b")
    assert e.value.code == 1 and "did you mean" in str(e.value.message) and "\n" not in str(e.value.message)


def test_catalog_cli_bad_user_file_is_one_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("recipes:\n  - alias: x\n    extends: qwen3.6-27b\n    bogus: 1\n")
    with pytest.raises(Exit) as e:
        cli.models(Context(), recipes=[str(p)])
    assert str(e.value.message).startswith(f"sparkprov: {p}:4:5: unknown key 'bogus'")


def test_catalog_cli_recipe_that_pip_installs_shows_its_derived_image_and_no_pip(capsys):
    """nemotron-3-nano-omni's `pip install 'vllm[audio]'` (001 §7.3.2) is baked into a derived image."""
    cli.recipe(Context(), "nemotron-3-nano-omni", argv=True)
    argv = json.loads(capsys.readouterr().out)
    assert argv[argv.index("--entrypoint") + 2].startswith("sparkprov/derived:")
    assert not [w for w in argv if "pip" in w]
    cli.recipe(Context(), "nemotron-3-nano-omni")
    out = capsys.readouterr().out
    assert "derived image: sparkprov/derived:" in out and "vllm[audio] baked in" in out and "pip install" not in out
