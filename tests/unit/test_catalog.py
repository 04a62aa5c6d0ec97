"""Catalog loading, user files and `extends`, rendering, and the lab-facing API."""

import json
import re
import textwrap

import pytest

from sparkprov.catalog.lint import lint_launch
from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.models import Source, degenerate
from sparkprov.catalog.render import KEY_PATH, HostServeContext, render_launch, shell_command
from sparkprov.serving.spec import recipe_container
from sparkprov.errors import InputError

CAT = load_catalog()
LINE_RE = re.compile(r"^\S+:\d+:\d+: .+")


def user_file(tmp_path, text, name="mine.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


# ---------------------------------------------------------------- data and sources

def test_catalog_every_value_carries_a_source():
    for r in CAT.recipes.values():
        assert r.source.note in {"000", "001", "002", "003", "004", "sparkprov"}
        for f in r.args:
            assert f.source is not None, (r.alias, f.flag)
        for e in r.env.values():
            assert e.source is not None
        for m in r.mounts:
            assert m.source is not None
        for field in ("model", "size_gb", "gated", "traits", "image", "tp_sizes"):
            assert r.source_of(field).note


def test_catalog_source_text_form():
    s = Source.model_validate("001 §7.1.1: --moe-backend marlin")
    assert (s.note, s.where, s.quote) == ("001", "§7.1.1", "--moe-backend marlin")
    assert s.cite() == "001 §7.1.1"
    assert Source.model_validate("002").cite() == "002"


def test_catalog_inherited_values_keep_the_parent_source():
    r = CAT.get("qwen3.6-35b-a3b-dflash")
    assert r.source.where == "§7.1.1 Tip"
    assert r.flag("--moe-backend").source.where == "§7.1.1"  # inherited flag
    assert r.flag("--attention-backend").source.quote.startswith("Keep --attention-backend triton_attn")
    assert r.source_of("size_gb").quote == "~19 GB NVFP4"
    assert r.flag("--kv-cache-dtype") is None  # removed (documented correction)
    assert r.kv_measured is None


def test_catalog_traits_tp_and_images():
    r = CAT.get("gemma-4-26b-a4b")
    assert r.tp_sizes == [1] and r.traits.moe and r.traits.quant == "nvfp4-modelopt"
    assert CAT.get("llama-3.3-70b").tp_sizes == [2]
    assert CAT.get("nemotron-3-nano").stage[0].filename == "nano_v3_reasoning_parser.py"
    assert CAT.image("vllm/vllm-openai:gemma4").gb10 is False
    assert CAT.image("nvcr.io/nvidia/vllm:26.04-py3").vllm_at_least("0.23") is False
    assert CAT.image("ghcr.io/aeon-7/vllm-dflash:latest").vllm_at_least("0.21") is True


def test_catalog_images_and_repos_for_the_lab():
    images = CAT.images()
    assert "vllm/vllm-openai:nightly" in images and "nvcr.io/nvidia/vllm:25.12.post1-py3" in images
    assert all(":" in i for i in images)
    repos = {r.repo: r for r in CAT.repos()}
    assert repos["nvidia/Qwen3.6-35B-A3B-NVFP4"].config["num_key_value_heads"] == 2
    assert repos["z-lab/Qwen3.6-35B-A3B-DFlash"].purpose == "drafter"
    assert repos["Qwen/Qwen3.6-35B-A3B"].purpose == "tokenizer"
    assert repos["meta-llama/Llama-3.3-70B-Instruct"].gated
    assert repos["nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-NVFP4"].files == ("nano_v3_reasoning_parser.py",)
    assert "qwen3.6-35b-a3b-mtp" in repos["nvidia/Qwen3.6-35B-A3B-NVFP4"].used_by


# ---------------------------------------------------------------- user files

def test_catalog_user_recipe_extends_and_overrides(tmp_path):
    p = user_file(tmp_path, """
        recipes:
          - alias: my-qwen
            extends: qwen3.6-35b-a3b
            source: "user: our lab, 2026-07"
            remove_args: [--enable-chunked-prefill]
            add_args:
              - --max-model-len: 32768
              - --speculative-config: {method: mtp, num_speculative_tokens: 2}
            traits: {thinking: "off"}
    """)
    cat = load_catalog([p])
    r = cat.get("my-qwen")
    assert r.flag("--enable-chunked-prefill") is None
    assert r.flag("--max-model-len").value == 32768
    assert r.flag("--max-model-len").source.note == "user"
    assert r.flag("--moe-backend").source.note == "001"
    assert r.traits.thinking == "off" and r.traits.moe  # merged key by key
    assert r.origin == str(p)
    args = render_launch(r, HostServeContext(), catalog=cat).vllm_argv
    assert args.index("--max-model-len") < args.index("--reasoning-parser")  # replaced in place


def test_catalog_user_file_overrides_a_builtin_by_alias(tmp_path):
    p = user_file(tmp_path, """
        recipes:
          - alias: qwen3.6-27b
            extends: qwen3.6-27b
            add_args: [{--gpu-memory-utilization: 0.5}]
    """)
    cat = load_catalog([p])
    assert cat.get("qwen3.6-27b").flag("--gpu-memory-utilization").value == 0.5
    assert cat.get("qwen3.6-27b-mtp").flag("--gpu-memory-utilization").value == 0.5  # children see it


def test_catalog_user_recipe_unknown_key_is_one_line(tmp_path):
    p = user_file(tmp_path, """
        recipes:
          - alias: x
            extends: qwen3.6-27b
            gpu_util: 0.5
    """)
    with pytest.raises(InputError) as e:
        load_catalog([p])
    line = e.value.line()
    assert LINE_RE.match(line) and "\n" not in line
    assert line.startswith(f"{p}:5:5: unknown key 'gpu_util'")


def test_catalog_user_recipe_unknown_extends_suggests(tmp_path):
    p = user_file(tmp_path, """
        recipes:
          - alias: x
            extends: qwen3.6-27
    """)
    with pytest.raises(InputError) as e:
        load_catalog([p])
    assert LINE_RE.match(e.value.line()) and "did you mean 'qwen3.6-27b'" in e.value.line()


def test_catalog_user_recipe_errors(tmp_path):
    cases = {
        "recipes:\n  - alias: x\n    extends: qwen3.6-27b\n    remove_args: [--nope]\n": "remove_args names --nope",
        "recipes:\n  - alias: x\n    image: a:b\n": "has no model",
        "recipes:\n  - alias: x\n    extends: qwen3.6-27b\n    traits: {quant: nvfp5}\n": "quant: Input should be",
        "recipes:\n  - alias: Bad Alias\n": "not a valid alias",
        "recipes:\n  - alias: x\n    extends: y\n  - alias: y\n    extends: x\n": "extends it back",
        "recipes:\n  - alias: x\n    extends: qwen3.6-27b\n    add_args: [--api-key: abc]\n": "API key in argv",
        "recipes:\n  - alias: x\n    extends: qwen3.6-27b\n    lint_ignore: [{rule: G10}]\n": "missing required key 'reason'",
        "recipes: [\n": "invalid YAML",
    }
    for i, (text, expect) in enumerate(cases.items()):
        p = tmp_path / f"bad{i}.yaml"
        p.write_text(text)
        with pytest.raises(InputError) as e:
            load_catalog([p])
        assert expect in e.value.line(), (text, e.value.line())
        assert e.value.line().startswith(str(p))


def test_catalog_user_images(tmp_path):
    p = user_file(tmp_path, """
        images:
          - ref: registry.lab/vllm-spark:1.0
            entrypoint: vllm-serve
            vllm: "0.23.1"
            gb10: true
            source: "user: built in our lab"
        recipes:
          - alias: x
            extends: qwen3.6-27b
            image: registry.lab/vllm-spark:1.0
    """)
    cat = load_catalog([p])
    launch = render_launch(cat.get("x"), HostServeContext(), catalog=cat)
    assert launch.command == "bare"
    assert not [f for f in lint_launch(launch, catalog=cat) if f.rule == "G1"]


# ---------------------------------------------------------------- rendering

def test_catalog_render_api_key_never_in_argv_or_env(tmp_path):
    ctx = HostServeContext(api_key_file="/etc/sparkprov/api_key")
    for r in CAT.recipes.values():
        launch = render_launch(r, ctx, min(r.tp_sizes), catalog=CAT)
        argv = recipe_container(launch).argv
        assert "--api-key" not in argv
        assert not any(e.name == "VLLM_API_KEY" for e in launch.env)
        assert f"/etc/sparkprov/api_key:{KEY_PATH}:ro" in argv
        script = argv[argv.index("-c") + 1]
        assert f"k=$(cat {KEY_PATH})" in script and 'exec "$@"' in script
        assert "HF_TOKEN" not in " ".join(argv)


def test_catalog_render_entrypoint_styles():
    bare = recipe_container(render_launch(CAT.get("qwen3.6-27b"),
                                          HostServeContext(api_key_file=None, bind_host="127.0.0.1"), catalog=CAT))
    i = bare.argv.index("vllm/vllm-openai:nightly")
    assert bare.argv[i + 1] == "unsloth/Qwen3.6-27B-NVFP4"  # G2: no `vllm serve` after the image
    full = recipe_container(render_launch(CAT.get("nemotron-3-nano"),
                                          HostServeContext(api_key_file=None, bind_host="127.0.0.1"), catalog=CAT))
    i = full.argv.index("nvcr.io/nvidia/vllm:25.12.post1-py3")
    assert full.argv[i + 1:i + 4] == ["vllm", "serve", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-NVFP4"]
    keyed = recipe_container(render_launch(CAT.get("nemotron-3-nano"), HostServeContext(), catalog=CAT))
    assert "--entrypoint" not in keyed.argv  # NGC keeps its entrypoint (forward compatibility, G5)
    i = keyed.argv.index("nvcr.io/nvidia/vllm:25.12.post1-py3")
    assert keyed.argv[i + 1:i + 3] == ["sh", "-c"]
    up = recipe_container(render_launch(CAT.get("qwen3.6-27b"), HostServeContext(), catalog=CAT))
    assert up.argv[up.argv.index("--entrypoint") + 1] == "sh"


def test_catalog_render_store_offline_labels_and_hash():
    ctx = HostServeContext(model_store="/srv/models", compile_cache="/srv/cc", port=8123, bind_host="10.0.0.5",
                           container_name="vllm-main")
    launch = render_launch(CAT.get("nemotron-3-nano"), ctx, catalog=CAT)
    c = recipe_container(launch)
    assert launch.env_value("HF_HOME") == "/srv/models" and launch.env_value("HF_HUB_OFFLINE") == "1"
    assert "/srv/models:/srv/models" in c.argv and "/srv/cc:/root/.cache/vllm" in c.argv
    assert launch.value("--reasoning-parser-plugin") == "/srv/models/nano_v3_reasoning_parser.py"
    assert launch.value("--port") == "8123" and launch.value("--host") == "10.0.0.5"
    assert c.labels["sparkprov.managed"] == "1" and c.labels["sparkprov.recipe"] == "nemotron-3-nano"
    assert re.fullmatch(r"[0-9a-f]{16}", c.hash) and c.labels["sparkprov.recipe_hash"] == c.hash
    again = recipe_container(render_launch(CAT.get("nemotron-3-nano"), ctx, catalog=CAT))
    assert again.hash == c.hash
    other = recipe_container(render_launch(CAT.get("nemotron-3-nano"), ctx.model_copy(update={"port": 8124}),
                                           catalog=CAT))
    assert other.hash != c.hash
    assert c.argv[:3] == ["docker", "run", "-d"] and "--name" in c.argv and "vllm-main" in c.argv


def test_catalog_render_tp2_fabric_env_and_flags():
    ctx = HostServeContext(fabric_ifaces=["enp1s0f1np1", "enP2p1s0f1np1"], ib_hcas=["rocep1s0f1", "roceP2p1s0f1"],
                           node_ip="192.168.100.10", cluster_size=2)
    launch = render_launch(CAT.get("llama-3.3-70b"), ctx, tp=2, catalog=CAT)
    assert launch.env_value("NCCL_SOCKET_IFNAME") == "enp1s0f1np1,enP2p1s0f1np1"
    assert launch.env_value("GLOO_SOCKET_IFNAME") == launch.env_value("UCX_NET_DEVICES") == "enp1s0f1np1,enP2p1s0f1np1"
    assert launch.env_value("NCCL_IB_HCA") == "rocep1s0f1,roceP2p1s0f1"
    assert launch.env_value("VLLM_HOST_IP") == "192.168.100.10"
    assert launch.value("--tensor-parallel-size") == "2"
    assert launch.value("--distributed-executor-backend") == "ray"
    assert launch.arg("--tensor-parallel-size").source.cite() == "001 §13"


def test_catalog_render_tp_replaces_the_recipe_value():
    launch = render_launch(CAT.get("qwen3-coder-next"), HostServeContext(), tp=2, catalog=CAT)
    assert launch.vllm_argv.count("--tensor-parallel-size") == 1 and launch.value("--tensor-parallel-size") == "2"
    one = render_launch(CAT.get("qwen3.6-35b-a3b"), HostServeContext(), tp=1, catalog=CAT)
    assert one.arg("--tensor-parallel-size").origin == "recipe"


def test_catalog_render_overrides():
    launch = render_launch(CAT.get("qwen3.6-35b-a3b"), HostServeContext(), 1,
                           {"--max-model-len": 32768, "--enable-chunked-prefill": None, "--enforce-eager": True},
                           catalog=CAT)
    assert launch.value("--max-model-len") == "32768" and launch.arg("--max-model-len").origin == "override"
    assert not launch.has("--enable-chunked-prefill") and launch.has("--enforce-eager")
    with pytest.raises(InputError):
        render_launch(CAT.get("qwen3.6-35b-a3b"), HostServeContext(), 1, {"max-model-len": 1}, catalog=CAT)
    with pytest.raises(InputError):
        render_launch(CAT.get("qwen3.6-35b-a3b"), HostServeContext(), 0, catalog=CAT)


def test_catalog_render_argv_is_a_list_and_json_values_are_compact():
    launch = render_launch(CAT.get("qwen3.6-35b-a3b"), HostServeContext(), catalog=CAT)
    assert all(isinstance(w, str) for w in recipe_container(launch).argv)
    assert launch.value("--speculative-config") == '{"method":"mtp","num_speculative_tokens":3,"moe_backend":"triton"}'
    assert json.loads(launch.value("--speculative-config"))["num_speculative_tokens"] == 3


def test_catalog_host_vars_context():
    ctx = HostServeContext.from_host_vars("spark1", {
        "model_store": "/data/models", "serve_port": 9000, "fabric_ifaces": "enp1s0f1np1, enP2p1s0f1np1",
        "fabric_ip": "192.168.100.11", "api_key_file": None, "hf_token_file": "/etc/sparkprov/hf_token",
        "unrelated": 1})
    assert ctx.host == "spark1" and ctx.model_store == "/data/models" and ctx.port == 9000
    assert ctx.fabric_ifaces == ["enp1s0f1np1", "enP2p1s0f1np1"] and ctx.node_ip == "192.168.100.11"
    assert ctx.api_key_file is None and ctx.hf_token_available is True


def test_catalog_smoke_spec_detects_degenerate_output():
    smoke = CAT.get("qwen3.6-35b-a3b").smoke
    assert smoke.check("12*17 = 204") == []
    assert any("G8" in p for p in smoke.check("!!!!!!!!"))
    assert any("G8" in p for p in smoke.check(""))
    assert degenerate("!!!!") and not degenerate("204")


# ---- positional model, shared defaults, a pasteable command (issue 13)

def test_catalog_every_render_passes_the_model_positionally():
    from sparkprov.catalog.knownflags import REPLACED

    cat = load_catalog()
    for r in cat.recipes.values():
        for tp in r.tp_sizes:
            launch = render_launch(r, HostServeContext(), tp, catalog=cat)
            assert launch.vllm_args[0].flag is None and launch.vllm_args[0].value == r.model.served_ref
            assert not launch.has("--model"), r.alias
            # no removed or deprecated option in any catalog recipe
            assert not [a.flag for a in launch.vllm_args if a.flag in REPLACED], r.alias
            argv = recipe_container(launch).argv
            serve = argv.index("serve") if "serve" in argv else None
            tail = argv[serve + 1:] if serve is not None else argv[argv.index(launch.image) + 1:]
            assert tail[0] == r.model.served_ref


def test_catalog_override_of_model_is_refused():
    cat = load_catalog()
    with pytest.raises(InputError, match="positional"):
        render_launch(cat.get("qwen3.6-27b"), HostServeContext(), 1, {"--model": "x"}, catalog=cat)


def test_catalog_render_without_host_uses_shared_defaults_and_pastes_into_a_shell():
    import shlex

    from sparkprov.defaults import API_KEY_FILE, COMPILE_CACHE, MODEL_STORE

    cat = load_catalog()
    launch = render_launch(cat.get("qwen3.6-27b"), HostServeContext(), 1, catalog=cat)
    assert (launch.ctx.model_store, launch.ctx.compile_cache, launch.ctx.api_key_file) == (
        MODEL_STORE, COMPILE_CACHE, API_KEY_FILE)
    text = shell_command(recipe_container(launch).argv)
    assert "'~" not in text and "~/" not in text
    words = shlex.split(text.replace('"$HOME"', "/home/u"))  # what the shell hands docker
    assert "/home/u/vllm:/home/u/vllm" in words and "HF_HOME=/home/u/vllm" in words
    assert "/home/u/.config/sparkprov/api_key:/run/secrets/sparkprov_api_key:ro" in words
    assert "/home/u/vllm-compile-cache:/root/.cache/vllm" in words


def test_catalog_render_for_a_host_has_absolute_paths_and_no_home_variable():
    cat = load_catalog()
    ctx = HostServeContext.from_host_vars("spark1", {}, home="/home/nvidia")
    launch = render_launch(cat.get("qwen3.6-27b"), ctx, 1, catalog=cat)
    assert ctx.model_store == "/home/nvidia/vllm" and "$HOME" not in shell_command(recipe_container(launch).argv)


def test_catalog_has_every_runnable_seed_configuration_of_issue_13():
    cat = load_catalog()
    want = {
        "qwen3.6-27b-yarn-1m": "001 §7.1.2 Tip", "qwen3.6-35b-a3b-256k": "001 §8 Walkthrough",
        "qwen3.6-27b-aeon-ultimate-dflash": "001 §14.4 Tip", "qwen3.6-35b-a3b-heretic-dflash": "001 §7.1.1 Tip",
        "gemma-4-26b-a4b-dflash": "001 §14.5", "qwen3.6-27b-ngram": "001 §14.2",
        "qwen3.6-27b-suffix": "001 §14.2 Tip", "nemotron-3-nano-omni-ngc": "001 §7.3.2", "gpt-oss-120b-tp2": "004",
    }
    for alias, cited in want.items():
        r = cat.get(alias)
        quoted = " | ".join(str(s) for s in [r.source, *r.sources.values()] + [f.source for f in r.args if f.source])
        assert cited in quoted, (alias, quoted)
    assert cat.get("qwen3.6-27b-aeon-ultimate-dflash").image == "ghcr.io/aeon-7/aeon-vllm-ultimate:latest"
    assert cat.get("gemma-4-26b-a4b-dflash").image == "ghcr.io/z-lab/vllm-openai:gemma4-dflash-cu130"
    assert cat.get("nemotron-3-nano-omni-ngc").image == "nvcr.io/nvidia/vllm:26.04-py3"
    assert cat.get("gpt-oss-120b-tp2").tp_sizes == [2]
    yarn = render_launch(cat.get("qwen3.6-27b-yarn-1m"), HostServeContext(), 1, catalog=cat)
    assert yarn.value("--max-model-len") == "1010000" and yarn.env_value("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1"
    assert json.loads(yarn.value("--hf-overrides"))["text_config"]["rope_parameters"]["factor"] == 4.0
