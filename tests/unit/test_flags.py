"""Serve options checked against the vLLM inside the image (G4): the recorded sets, the parser of
`vllm serve --help=all`, the per-digest cache, and the lint rule that names flag, image and version."""

from pathlib import Path

import pytest

from sparkprov.catalog.knownflags import (FLAGS_DIR, known_flags, load_recorded, parse_help, recorded_set_name,
                                          write_cache)
from sparkprov.catalog.lint import ERROR, WARNING, lint_launch
from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch

CAT = load_catalog()
HELP = (Path(__file__).parents[1] / "fixtures" / "flags" / "vllm-serve-help-all.txt").read_text()
DIGEST = "sha256:" + "ab" * 32


def g4(alias, overrides=None, **kw):
    r = CAT.get(alias)
    launch = render_launch(r, HostServeContext(), min(r.tp_sizes), overrides, catalog=CAT)
    return [f for f in lint_launch(launch, catalog=CAT, **kw) if f.rule == "G4" and f.severity == ERROR]


def test_parse_help_reads_the_option_column_only():
    flags = parse_help(HELP)
    assert {"--host", "--port", "--max-model-len", "--tensor-parallel-size", "--nnodes", "--node-rank",
            "--headless", "--api-server-count", "--enable-auto-tool-choice", "--no-enable-auto-tool-choice",
            "--gpu-memory-utilization", "--kv-cache-dtype", "--quantization", "--model", "--help", "--config",
            "--distributed-executor-backend", "--tool-call-parser", "--trust-remote-code",
            "--no-trust-remote-code"} == flags
    # `--max-model-len ...` in the help text of --config and `--kv-cache-dtype` inside another
    # option's help are prose, not options; the usage line names no option
    assert "--max_model_len" not in flags


def test_write_cache_refuses_output_that_is_not_serve_help(tmp_path):
    with pytest.raises(ValueError, match="not `vllm serve --help=all` output"):
        write_cache(tmp_path, DIGEST, "docker: Error response from daemon: pull access denied\n")
    assert list(tmp_path.iterdir()) == []


def test_recorded_sets_cover_every_flag_of_every_catalog_recipe_on_its_own_image():
    for r in CAT.recipes.values():
        for tp in r.tp_sizes:
            launch = render_launch(r, HostServeContext(), tp, catalog=CAT)
            assert [f.line() for f in lint_launch(launch, catalog=CAT) if f.rule == "G4" and f.severity == ERROR] == []


def test_recorded_sets_by_image_version():
    assert recorded_set_name(CAT.image("nvcr.io/nvidia/vllm:26.04-py3")) == "vllm-0.19"
    assert recorded_set_name(CAT.image("vllm/vllm-openai:nightly")) == "vllm-0.23"
    assert recorded_set_name(CAT.image("ghcr.io/aeon-7/aeon-vllm-ultimate:latest")) == "vllm-0.21"  # a floor
    assert recorded_set_name(CAT.image("nvcr.io/nvidia/vllm:25.12.post1-py3")) == "vllm-0.12"  # a ceiling
    assert recorded_set_name(CAT.image("spark-vllm-mxfp4:latest")) == "mxfp4-community"
    assert recorded_set_name(CAT.image("vllm/vllm-openai:gemma4-cu130")) is None  # vLLM unknown: no guess
    mx = load_recorded("mxfp4-community")
    assert mx.knows("--mxfp4-backend") and mx.knows("--mxfp4-layers")
    assert not load_recorded("vllm-0.23").knows("--mxfp4-backend")
    for p in FLAGS_DIR.glob("*.txt"):  # every recorded file reads
        assert load_recorded(p.stem).flags


def test_g4_mxfp4_flags_fail_on_upstream_vllm_naming_flag_image_and_version(tmp_path):
    user = tmp_path / "u.yaml"
    user.write_text("recipes:\n  - alias: broken\n    extends: gpt-oss-120b\n    image: vllm/vllm-openai:nightly\n"
                    "    command: bare\n")
    cat = load_catalog([user])
    launch = render_launch(cat.get("broken"), HostServeContext(), 1, catalog=cat)
    found = [f for f in lint_launch(launch, catalog=cat) if f.rule == "G4" and f.severity == ERROR]
    assert sorted(f.message.split()[0] for f in found) == ["--mxfp4-backend", "--mxfp4-layers"]
    assert all("vllm/vllm-openai:nightly (vLLM 0.23; recorded set: vllm-0.23)" in f.message for f in found)
    assert g4("gpt-oss-120b") == []  # on its own image they exist


def test_g4_unknown_flag_in_an_override_and_the_removed_spec_flag():
    found = g4("qwen3.6-27b", {"--speculative-disable-by-batch-size": 32, "--max_model_len": 8192})
    assert len(found) == 1  # --max_model_len is vLLM's underscore spelling of a known option
    assert found[0].message.startswith("--speculative-disable-by-batch-size is not an option of the vLLM in "
                                       "vllm/vllm-openai:nightly (vLLM 0.23")
    assert "disable_by_batch_size" in found[0].fix and found[0].sources[0] == "override render_launch(overrides=...)"


def test_g4_cached_image_answer_wins_over_the_recorded_set(tmp_path):
    write_cache(tmp_path, DIGEST, HELP, image="nvcr.io/nvidia/vllm:26.04-py3", vllm_version="0.19.0")
    fs = known_flags("nvcr.io/nvidia/vllm:26.04-py3", CAT, tmp_path, digest=DIGEST)
    assert fs.origin == "image" and fs.knows("--nnodes") and not fs.knows("--moe-backend")
    assert fs.knows_env("VLLM_USE_DEEP_GEMM")  # env vars still from the recorded set of 0.19
    # the image's own answer lacks --max-num-seqs: the launch fails, citing the image's answer
    found = g4("llama-3.3-70b", flags_cache=str(tmp_path), image_digest=DIGEST)
    assert "--max-num-seqs" in {f.message.split()[0] for f in found}
    assert all("the image's own `vllm serve --help=all`: " + DIGEST in f.message for f in found)
    # without the digest the recorded set answers, and it knows every flag of the recipe
    assert g4("llama-3.3-70b", flags_cache=str(tmp_path)) == []


def test_g4_deprecated_model_flag_warns():
    r = CAT.get("qwen3.6-27b")
    launch = render_launch(r, HostServeContext(), 1, {"--served-model-name": "x"}, catalog=CAT)
    launch.vllm_args.append(launch.vllm_args[-1].model_copy(update={"flag": "--model", "value": "/m"}))
    found = [f for f in lint_launch(launch, catalog=CAT) if f.rule == "G4" and f.message.startswith("--model")]
    assert len(found) == 1 and found[0].severity == WARNING and "positional" in found[0].fix


def test_parse_help_reads_the_lab_engines_help_all_and_it_knows_the_catalogs_flags(tmp_path):
    # the lab's vLLM stand-in answers `vllm serve --help=all` the way vLLM does (argparse format)
    from sparklab.engine import cli as lab_cli

    _top, serve = lab_cli.build_parser()
    text = lab_cli.serve_help(serve, "all")
    flags = parse_help(text)
    used = {a.flag for r in CAT.recipes.values() for a in r.args}
    assert used - flags == {"--mxfp4-backend", "--mxfp4-layers"}  # the community image's own
    assert {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"} <= flags
    path = write_cache(tmp_path, DIGEST, text, image="vllm/vllm-openai:nightly", vllm_version="0.23")
    fs = known_flags("vllm/vllm-openai:nightly", CAT, tmp_path, digest=DIGEST)
    assert fs.origin == "image" and fs.path == str(path) and not fs.knows("--mxfp4-backend")


def test_a_set_cached_by_an_older_parser_is_not_read(tmp_path):
    """Root's cache held sets written by the parse_help that read the epilog's `--json-arg` examples
    as an option (2026-11-26): they were read as the image's own answer. A set is cached under the
    parser's version, so an older one is asked again (image_flags sees no file) and never read."""
    from sparkprov.catalog.knownflags import PARSER_VERSION, cache_path, known_flags

    old = tmp_path / DIGEST.replace(":", "-")
    old.with_suffix(".txt").write_text("# an older parser's set\n--json-arg\n--max-model-len\n")
    assert not cache_path(tmp_path, DIGEST).exists()
    path = write_cache(tmp_path, DIGEST, HELP, image="nvcr.io/nvidia/vllm:26.04-py3", vllm_version="0.19.0")
    assert path.name == f"{DIGEST.replace(':', '-')}.p{PARSER_VERSION}.txt"
    fs = known_flags(f"nvcr.io/nvidia/vllm:26.04-py3@{DIGEST}", None, cache_dir=tmp_path)
    assert fs.origin == "image" and not fs.knows("--json-arg") and fs.knows("--max-model-len")
