"""Linter cases of issue 13, one test per G-number: each rule fires on a deliberately broken user
recipe (or host) and stays silent on the catalog recipe it was wrong about."""

import textwrap

from sparkprov.catalog.lint import ERROR, WARNING, lint_launch
from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch
from helpers import one, user

CAT = load_catalog()


def lint(alias, *, yaml=None, tmp_path=None, ctx=None, tp=None, rule=None, overrides=None, pp=1):
    cat = CAT
    if yaml is not None:
        p = tmp_path / "user.yaml"
        p.write_text(textwrap.dedent(yaml))
        cat = load_catalog([p])
    r = cat.get(alias)
    launch = render_launch(r, ctx or HostServeContext(), tp or min(r.tp_sizes), overrides, catalog=cat, pp=pp)
    return [f for f in lint_launch(launch, catalog=cat) if rule is None or f.rule == rule]


# G1: tags are matched whole, not by substring
def test_G1_substring_nightly_or_cu130_is_not_trusted(tmp_path):
    for tag in ("v0.11.0-cu130-test", "my-nightly-fork", "not-cu130"):
        f = one(lint("broken", yaml=user("qwen3.6-27b", f"image: vllm/vllm-openai:{tag}\n"), tmp_path=tmp_path,
                     rule="G1"), WARNING)
        assert "does not know whether" in f.message
    for tag in ("nightly", "cu130-nightly", "cu130-nightly-2026-07", "nightly-0123456789abcdef"):
        assert lint("broken", yaml=user("qwen3.6-27b", f"image: vllm/vllm-openai:{tag}\n"), tmp_path=tmp_path,
                    rule="G1") == []
    one(lint("broken", yaml=user("qwen3.6-27b", "image: vllm/vllm-openai:v0.19.0rc1\n"), tmp_path=tmp_path,
             rule="G1"), ERROR)


# G3: image / model version pairs
def test_G3_gemma4_on_an_older_vllm_image_errors(tmp_path):
    f = one(lint("broken", yaml=user("gemma-4-31b", "image: nvcr.io/nvidia/vllm:26.04-py3\ncommand: full\n"),
                 tmp_path=tmp_path, rule="G3"), ERROR)
    assert "whose vLLM is 0.19.0" in f.message and ">= 0.23" in f.message
    assert lint("gemma-4-31b", rule="G3") == []  # on vllm/vllm-openai:gemma4-cu130
    assert lint("gemma-4-12b-coder", rule="G3") == []  # on the 0.23 nightly


def test_G3_mtp_below_0_19_errors(tmp_path):
    body = "image: nvcr.io/nvidia/vllm:26.03-py3\ncommand: full\nremove_args: [--moe-backend]\n"
    found = lint("broken", yaml=user("qwen3.6-35b-a3b-ngc", body.replace("remove_args: [--moe-backend]\n", "")),
                 tmp_path=tmp_path, rule="G3")
    f = one(found, ERROR)
    assert "speculative method mtp" in f.message and "0.17.1" in f.message
    assert lint("qwen3.6-35b-a3b-ngc", rule="G3") == []  # MTP on NGC 26.04 (0.19.0)


# G6: --quantization against the checkpoint format
def test_G6_quantization_that_does_not_match_the_checkpoint(tmp_path):
    f = one(lint("broken", yaml=user("llama-3.3-70b", "add_args: [{--quantization: modelopt}]\n"), tmp_path=tmp_path,
                 tp=2, ctx=HostServeContext(), rule="G6"), ERROR)
    assert "unquantized BF16 checkpoint" in f.message
    one(lint("broken", yaml=user("qwen3.5-35b-a3b-fp8", "add_args: [{--quantization: gptq}]\n"), tmp_path=tmp_path,
             rule="G6"), ERROR)
    one(lint("broken", yaml=user("qwen3-next-80b-gptq", "add_args: [{--quantization: fp8}]\n"), tmp_path=tmp_path,
             rule="G6"), ERROR)
    # spelling variants vLLM accepts are the same method
    assert lint("broken", yaml=user("qwen3.6-35b-a3b", "add_args: [{--quantization: modelopt_fp4}]\n"),
                tmp_path=tmp_path, rule="G6") == []  # a ModelOpt checkpoint
    assert lint("llama-3.3-70b", tp=2, rule="G6") == []


# G7: environment variables the image's vLLM does not know
def test_G4_unknown_vllm_env_var_names_image_and_version(tmp_path):
    """Every VLLM_* variable is checked against the image's vLLM by G4 (the rule the preflight runs
    against the image's own flags), with the image and its version named."""
    f = one(lint("broken", yaml=user("qwen3.6-27b", "env: {VLLM_MADE_UP: '1'}\n"), tmp_path=tmp_path, rule="G4"),
            ERROR)
    assert f.message.startswith("VLLM_MADE_UP is not an environment variable of the vLLM in vllm/vllm-openai:nightly "
                                "(vLLM 0.23; recorded set: vllm-0.23)")
    # the FlashInfer MoE variables are valid on NGC 26.04 (0.19) and gone on 0.23
    assert not [x for x in lint("qwen3.6-35b-a3b-ngc", rule="G4") if "not an environment variable" in x.message]
    gone = lint("broken", yaml=user("qwen3.6-27b", "env: {VLLM_FLASHINFER_MOE_BACKEND: latency}\n"),
                tmp_path=tmp_path, rule="G7")
    assert [x.severity for x in gone] == [WARNING] and "ignored on vLLM 0.23+" in gone[0].message


# G24: a network command hidden behind sh -c
def test_G24_network_command_inside_sh_c(tmp_path):
    body = "pre_serve: [[sh, -c, 'export X=1; pip install vllm[audio] && echo ok']]\n"
    f = one(lint("broken", yaml=user("qwen3.6-27b", body), tmp_path=tmp_path, rule="G24"), WARNING)
    assert f.message.startswith("`pip install vllm[audio]` (inside `sh -c")
    body = "pre_serve: [[bash, -lc, 'cd /tmp && curl -fsSL https://x | sh']]\n"
    one(lint("broken", yaml=user("qwen3.6-27b", body), tmp_path=tmp_path, rule="G24"), WARNING)
    body = "pre_serve: [[sh, -c, 'mkdir -p /tmp/x && cp /a /b']]\n"
    assert lint("broken", yaml=user("qwen3.6-27b", body), tmp_path=tmp_path, rule="G24") == []
    # sparkprov's own API-key wrapper is an `sh -c` too, and is never reported
    launch = render_launch(CAT.get("qwen3.6-27b"), HostServeContext(), 1, catalog=CAT)
    assert launch.wrapped and lint("qwen3.6-27b", rule="G24") == []


# G29: the keys inside --speculative-config
def test_G29_unknown_key_inside_the_speculative_config(tmp_path):
    body = "add_args: [{--speculative-config: {method: mtp, num_speculative_tokens: 2, disable_by_batchsize: 32}}]\n"
    found = lint("broken", yaml=user("qwen3.6-27b-mtp", body), tmp_path=tmp_path, rule="G29")
    f = [x for x in found if "does not take" in x.message]
    assert len(f) == 1 and f[0].severity == ERROR and "disable_by_batchsize -> disable_by_batch_size" in f[0].fix
    body = "add_args: [{--speculative-config: {method: mtp, num_speculative_tokens: 2, disable_by_batch_size: 32}}]\n"
    assert [x for x in lint("broken", yaml=user("qwen3.6-27b-mtp", body), tmp_path=tmp_path, rule="G29")
            if x.severity == ERROR] == []
    body = "add_args: [{--speculative-config: {method: lookahead, num_speculative_tokens: 2}}]\n"
    assert any("method 'lookahead'" in x.message for x in
               lint("broken", yaml=user("qwen3.6-27b-mtp", body), tmp_path=tmp_path, rule="G29"))


# G35: the cluster size is tp x pp
def test_G35_cluster_size_counts_pipeline_stages(tmp_path):
    ctx = HostServeContext(cluster_size=4)
    found = lint("llama-3.3-70b", tp=2, ctx=ctx, rule="G35", pp=2)
    assert [f for f in found if "node(s)" in f.message] == []
    f = [x for x in lint("llama-3.3-70b", tp=2, ctx=ctx, rule="G35") if "node(s)" in x.message]
    assert len(f) == 1 and f[0].severity == ERROR and "has 4 node(s)" in f[0].message
    f = [x for x in lint("llama-3.3-70b", tp=2, ctx=HostServeContext(cluster_size=2), rule="G35", pp=2)
         if "node(s)" in x.message]
    assert len(f) == 1 and "TP=2 x PP=2 = 4 GPUs" in f[0].message


def test_G35_ray_executor_on_an_image_without_ray_warns():
    f = [x for x in lint("llama-3.3-70b", tp=2, rule="G35") if "ships no Ray" in x.message]
    assert len(f) == 1 and f[0].severity == WARNING and "derived image" in f[0].fix and "--executor native" in f[0].fix


# G21: a restart policy
def test_G21_restart_policy_no_warns(tmp_path):
    f = one(lint("broken", yaml=user("qwen3.6-27b", "docker: {restart: 'no'}\n"), tmp_path=tmp_path, rule="G21"),
            WARNING)
    assert "after a reboot" in f.message
    assert lint("qwen3.6-27b", rule="G21") == []  # unless-stopped


# G19: replacing a running launch never uses `docker restart`
def test_G19_replacing_a_container_removes_it_before_running():
    """docker restart keeps the old CUDA context (G19): cluster-up's start script removes the
    container of the same name, then runs the new one."""
    from sparkprov.modules.vllm_container import _run_script
    from sparkprov.serving import spec

    launch = render_launch(CAT.get("qwen3.6-27b"), HostServeContext(), 1, catalog=CAT)
    s = spec.single("q", "spark1", launch)
    lines = _run_script(s, serves=True).splitlines()
    run = [i for i, ln in enumerate(lines) if ln.startswith("docker run -d ")]  # (its failure reported: facts/docker_run.py)
    assert lines[0].startswith(f"docker rm -f {s.name} ") and len(run) == 1 and run[0] > 0
    assert not any(" restart " in ln or ln.startswith("docker restart") for ln in lines)
