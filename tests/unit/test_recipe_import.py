"""`invoke recipe import`: recipes of eugr/spark-vllm-docker and of sparkrun/spark-pulse
(recipe_version "2") become sparkprov user recipes, linted with the G-rules.

The real recipes among the fixtures (their source named in each file's header):
- eugr-gemma4-26b-a4b-fp8-speculative.yaml: eugr/spark-vllm-docker recipes/gemma4-26b-a4b-fp8-speculative.yaml
  at b178977e6e4cebbdd6fcfb7bd0113520d83e111a (doubled braces in the command);
- eugr-gemma4-26b-a4b-nvfp4.yaml: eugr/spark-vllm-docker recipes/gemma4-26b-a4b-nvfp4.yaml at
  98cbf9475a8184cc00b302286ec07ff9afeeb0fe (a mod);
- sparkrun-v2-unsloth-qwen36-35b-a3b-nvfp4.yaml: mfellner/sparkrun-recipes
  recipes/unsloth-qwen3.6-35b-a3b-nvfp4-dgx-spark.yaml at 5048fdbfa49e38cd237495ab748d0704e1936e20.
The others are written for these tests.
"""

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from invoke import Context, Exit

from sparkprov.catalog.importer import convert, detect_format, import_file, lint_imported
from sparkprov.catalog.lint import ERROR, errors
from sparkprov.cli.catalog import recipe, recipe_import
from sparkprov.errors import InputError
from sparkprov.serving.spec import recipe_container
from sparkprov.yamlpos import load_yaml

FIX = Path(__file__).parents[1] / "fixtures" / "recipes-foreign"


def imported(tmp_path, name, **kw):
    imp = import_file(FIX / name, **kw)
    out = tmp_path / f"{imp.alias}.yaml"
    launch, findings = lint_imported(imp.yaml_text(name), imp.alias, out)
    assert not out.exists()  # linted from memory
    return imp, launch, findings


def test_formats_are_told_apart():
    assert detect_format(yaml.safe_load((FIX / "eugr-qwen36-27b.yaml").read_text())) == "eugr"
    assert detect_format(yaml.safe_load((FIX / "sparkrun-v2-qwen36-35b.yaml").read_text())) == "sparkrun-v2"
    with pytest.raises(InputError, match="unknown recipe format"):
        detect_format({"recipe_version": "7", "model": "x"})
    with pytest.raises(InputError, match="vLLM only"):
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
    assert "sk-not-a-real-key" not in imp.yaml_text("x") and "sk-not-a-real-key" not in " ".join(recipe_container(launch).argv)
    lines = [f.line() for f in findings if f.severity == ERROR]
    assert any(l.startswith("ERROR G4 gpt-oss-120b-upstream: --mxfp4-backend is not an option of the vLLM in "
                            "vllm/vllm-openai:v0.24.0 (vLLM 0.24.0") for l in lines)
    assert any("--speculative-disable-by-batch-size" in l and "disable_by_batch_size" in l for l in lines)
    assert any(l.startswith("ERROR G7") and "VLLM_MXFP4_USE_MARLIN=1" in l for l in lines)
    assert any(l.startswith("ERROR G1") for l in lines)  # an upstream release tag on GB10


# -- real recipes --------------------------------------------------------------------------------------

def test_real_eugr_recipe_doubled_braces_become_json(tmp_path):
    """eugr's run-recipe.py fills the command with str.format, so the recipe writes a literal brace
    as `{{`; kept doubled, the container got `{{"method":"mtp",...}}`, which is not JSON."""
    imp, launch, findings = imported(tmp_path, "eugr-gemma4-26b-a4b-fp8-speculative.yaml")
    assert launch.speculative == {"method": "mtp", "model": "google/gemma-4-26B-A4B-it-assistant",
                                  "num_speculative_tokens": 4, "moe_backend": "triton"}
    assert not any("{{" in word or "}}" in word for word in recipe_container(launch).argv)
    assert launch.model_arg == "google/gemma-4-26B-A4B-it" and launch.recipe.tp_sizes == [2]
    assert launch.value("--max-num-batched-tokens") == "8192" and errors(findings) == []


def test_real_eugr_recipe_with_a_mod_reports_it(tmp_path):
    imp, launch, findings = imported(tmp_path, "eugr-gemma4-26b-a4b-nvfp4.yaml")
    assert imp.problems == ["mods (fix-gemma4-nvfp4-moe) change the image or run scripts at start: not imported; "
                            "bake them into a derived image and name it in image:"]
    assert launch.image == "vllm-node-tf5:latest" and launch.value("--moe-backend") == "marlin"
    assert launch.env_value("VLLM_NVFP4_GEMM_BACKEND") == "marlin" and errors(findings) == []


def test_real_sparkrun_v2_recipe_keeps_digest_revision_and_json_values(tmp_path):
    imp, launch, findings = imported(tmp_path, "sparkrun-v2-unsloth-qwen36-35b-a3b-nvfp4.yaml")
    assert imp.fmt == "sparkrun-v2" and errors(findings) == []
    r = launch.recipe
    assert r.model.repo == "unsloth/Qwen3.6-35B-A3B-NVFP4" and r.model.revision == "739af1e7aac320af1682ed1e0cce369af4c5265d"
    assert launch.image == ("ghcr.io/miaai-lab/mia-vllm-gb10-linear-b12x@sha256:"
                            "19627342e1da2607f4db50745dca30e57d7dd0ebff06062f03fd69b43a252931")
    assert launch.speculative == {"method": "mtp", "num_speculative_tokens": 2, "moe_backend": "triton"}
    assert launch.value("--limit-mm-per-prompt") == '{"image":4}'
    assert launch.value("--served-model-name") == "unsloth/Qwen3.6-35B-A3B-NVFP4"  # {model} filled
    assert launch.model_arg == "unsloth/Qwen3.6-35B-A3B-NVFP4"  # the store's copy, not the container path
    assert [p.split(" ", 1)[0] for p in imp.problems] == ["pre_exec", "the"]
    assert list(imp.document()) == ["recipes"]  # a digest is kept in image:, never as an images: entry


# -- what is written ---------------------------------------------------------------------------------

BREAKS = ["\n", "\r\n", "\r", "\x85", "\u2028", "\u2029"]


def _with_breaks(i: int) -> str:
    b = BREAKS[i % len(BREAKS)]
    return f"line one{b}images:{b}  - ref: vllm/vllm-openai:nightly{b}recipes: []{b}# x"


def test_line_breaks_in_free_text_import_to_what_was_read(tmp_path):
    """The free text of the foreign recipe (name, description, mods, build_args, metadata) holds line
    breaks of every kind, and YAML that would be live if pasted into a hand-formatted file; none of
    it reaches the launch, and the written file parses to exactly the data the importer built. (A
    value that reaches the launch holding a line break is refused: test_import_one_value.py.)"""
    strings = iter(_with_breaks(i) for i in range(100))
    foreign = {
        "recipe_version": "1", "name": next(strings), "description": next(strings),
        "model": "org/model-7b", "container": "vllm/vllm-openai:cu130-nightly",
        "mods": [next(strings)], "build_args": [next(strings)], "env": {"V0": "one value"},
        "defaults": {"port": 8000, "served_model_name": "a name with spaces"},
        "command": "vllm serve org/model-7b --port {port} --served-model-name '{served_model_name}'",
        "metadata": {"description": next(strings)},
    }
    src = tmp_path / "in' images: [x] #.yaml"  # (a line break in --file is refused as an option)
    src.write_text(yaml.safe_dump(foreign, allow_unicode=True))
    out = tmp_path / "out.yaml"
    recipe_import(Context(), str(src), out=str(out))
    written, _ = load_yaml(out)
    imp = import_file(src)
    assert written == imp.document()
    assert list(written) == ["recipes"] and len(written["recipes"]) == 1
    got = written["recipes"][0]
    assert got["env"] == {"V0": "one value"}
    assert got["args"] == [{"--served-model-name": "a name with spaces"}]  # one value, one word
    assert got["title"] == " ".join(foreign["description"].split())  # one line: it stands in tables
    comments = [line for line in out.read_text().splitlines() if line.startswith("#")]
    assert len(comments) == 3 and all(line.isprintable() for line in comments)  # origin, mods, build_args
    assert out.read_text().count("\n#") == 2  # no comment line beyond those


def test_a_lone_next_line_or_separator_in_a_value_is_refused_at_its_line(tmp_path):
    """PyYAML reads a lone NEL (\\x85) back as a space once written single-quoted; in a value that
    reaches the launch, each of these splits one value into two lines: refused, at FILE:LINE:COL."""
    src = tmp_path / "in.yaml"
    for env in ('{A: "\\N"}', '{B: "x\\Ly"}', '{C: " \\P"}', '{D: "\\x1c"}'):
        src.write_text('recipe_version: "1"\nmodel: org/model-7b\ncontainer: vllm/vllm-openai:cu130-nightly\n'
                       f'command: vllm serve org/model-7b\nenv: {env}\n')
        exc = _run_import(tmp_path, src)
        assert exc.message.startswith(f"sparkprov: {src}:5:") and "holds a line break" in exc.message, exc.message


# -- bad input: one line, exit 1, nothing written ---------------------------------------------------

GOOD = yaml.safe_load((FIX / "eugr-qwen36-27b.yaml").read_text())
POSITIONED = re.compile(r"^sparkprov: (?P<file>.+?):(?P<line>\d+):(?P<col>\d+): \S")


def _run_import(tmp_path, src: Path, out: Path | None = None, **kw) -> Exit:
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(Exit) as err:
        recipe_import(Context(), str(src), out=str(out or tmp_path / "out.yaml"), **kw)
    exc = err.value
    assert exc.code == 1
    assert exc.message and exc.message.isprintable() and len(exc.message.splitlines()) == 1, exc.message
    assert "(fix: " in exc.message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary file left
    return exc


@pytest.mark.parametrize("change,at,words", [
    ({"env": ["A", "B"]}, "env", "Input should be a valid dictionary"),
    ({"defaults": {"max_model_len": [1, 2]}}, "defaults.max_model_len", "not a list"),
    ({"command": {"vllm": "serve"}}, "command", "expected text, not mapping"),
    ({"model": ["a/b"]}, "model", "expected text, not list"),
    ({"container": {"image": "x"}}, "container", "expected text, not mapping"),
    ({"mods": "fix-something"}, "mods", "valid list"),
    ({"name": True}, "name", "expected text, not true/false"),
    ({"recipe_version": ["1"]}, "recipe_version", "expected text, not list"),
    ({"model": "../../../etc/passwd", "command": "vllm serve {model}"}, "model", "not a Hugging Face repo id"),
    ({"container": "vllm/vllm-openai:nightly\n--privileged"}, "container", "holds a line break"),
    ({"container": "vllm/vllm-openai:nightly --privileged"}, "container", "not an image reference"),
    ({"defaults": {**GOOD["defaults"], "tensor_parallel": "two"}}, "defaults.tensor_parallel",
     "not a whole number"),
    ({"command": "vllm serve a/b --speculative-config '{{\"method\":\"mtp\",}}'"}, "command", "is not JSON"),
    ({"command": "vllm serve a/b --x 'unclosed"}, "command", "does not parse as shell words"),
    ({"command": "bash -c 'echo hi'"}, "command", "not `vllm serve MODEL"),
    ({"env": {"A B": "1"}}, "env.A B", "not an environment variable name"),
    ({"model_revision": "../main"}, "model_revision", "not a branch, tag or commit"),
])
def test_wrong_shapes_and_values_are_one_positioned_line(tmp_path, change, at, words):
    doc = {**GOOD, **change}
    src = tmp_path / "foreign.yaml"
    src.write_text(yaml.safe_dump(doc, sort_keys=False))
    exc = _run_import(tmp_path, src)
    m = POSITIONED.match(exc.message)
    assert m and m["file"] == str(src), exc.message
    _, pos = load_yaml(src)
    path = tuple(at.split("."))
    assert (int(m["line"]), int(m["col"])) in (pos.at(path), pos.at(path, key=True)), (exc.message, at)
    assert words in exc.message


def test_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)]
    src = tmp_path / "bomb.yaml"
    src.write_text("\n".join(lines) + "\ndefaults: {max_model_len: *i}\n" + yaml.safe_dump(
        {k: v for k, v in GOOD.items() if k != "defaults"}))
    exc = _run_import(tmp_path, src)
    assert "expands to more than" in exc.message


def test_a_placeholder_repeated_over_a_large_value_is_refused(tmp_path):
    doc = {**GOOD, "defaults": {"big": "x" * 100_000}, "command": "vllm serve a/b " + "--y {big} " * 50}
    src = tmp_path / "grow.yaml"
    src.write_text(yaml.safe_dump(doc))
    assert "grows past" in _run_import(tmp_path, src).message


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "missing", "not-utf8"])
def test_unreadable_inputs_are_one_line(tmp_path, kind):
    src = tmp_path / "in.yaml"
    if kind == "fifo":
        os.mkfifo(src)  # open() without O_NONBLOCK would wait for a writer forever
    elif kind == "dev-zero":
        src.symlink_to("/dev/zero")
    elif kind == "directory":
        src.mkdir()
    elif kind == "not-utf8":
        src.write_bytes(b"name: \xff\n")
    exc = _run_import(tmp_path, src)
    assert exc.message.startswith(f"sparkprov: {src}")


@pytest.mark.parametrize("kind", ["input", "directory", "proc", "dangling", "no-folder", "fifo"])
def test_bad_out_is_one_line_naming_the_option(tmp_path, kind):
    src = tmp_path / "in.yaml"
    src.write_text(yaml.safe_dump(GOOD))
    out = {"input": src, "directory": tmp_path, "proc": Path("/proc/self/comm"),
           "dangling": tmp_path / "link.yaml", "no-folder": tmp_path / "nowhere" / "x.yaml",
           "fifo": tmp_path / "pipe"}[kind]
    if kind == "dangling":
        out.symlink_to(tmp_path / "gone" / "x.yaml")
    if kind == "fifo":
        os.mkfifo(out)
    exc = _run_import(tmp_path, src, out=out)
    assert exc.message.startswith(f"sparkprov: --out {str(out)!r}: "), exc.message
    assert src.read_text() == yaml.safe_dump(GOOD)


def test_unknown_variant_and_bad_name_are_one_line(tmp_path):
    src = FIX / "sparkrun-v2-qwen36-35b.yaml"
    assert "variants in" in _run_import(tmp_path, src, variant="short").message
    assert "--name 'Bad Name'" in _run_import(tmp_path, src, name="Bad Name").message


def test_cli_recipe_import_writes_the_file_and_exits_by_errors(tmp_path, capsys):
    out = tmp_path / "mine.yaml"
    recipe(Context(), "import", file=str(FIX / "eugr-qwen36-27b.yaml"), out=str(out))
    assert out.is_file() and "alias: qwen3.6-27b-nvfp4" in out.read_text()
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert "0 error(s)" in capsys.readouterr().err
    with pytest.raises(Exit) as e:
        recipe_import(Context(), str(FIX / "eugr-broken.yaml"), out=str(tmp_path / "b.yaml"))
    assert e.value.code == 1 and e.value.message is None  # lint errors: written, to be edited
    assert (tmp_path / "b.yaml").is_file()
    printed = capsys.readouterr().out
    assert "NOT IMPORTED gpt-oss-120b-upstream: --api-key" in printed and "ERROR G4" in printed
    with pytest.raises(Exit) as e:
        recipe(Context(), "import")
    assert e.value.code == 1 and e.value.message == ("sparkprov: recipe import needs --file FILE (fix: name a recipe "
                                                     "of eugr/spark-vllm-docker, sparkrun, spark-pulse or NVIDIA's recipe catalog)")


# -- generated foreign recipes through the real command ------------------------------------------------

NASTY = ["'", '"', "{", "}", "{{", "}}", "{port}", "{nope}", "\\", "\n", "\r", "\u2028", "\x85", "$(id)", "`id`",
         ";", "#", ": ", "- ", "&a", "*a", "!!python/object:os.system", "..", "../../etc/passwd", "--privileged",
         "-tp", "--x=1", " ", "\t", "é", "\u202e", "%s"]
text = st.lists(st.one_of(st.sampled_from(NASTY), st.text(max_size=3)), max_size=5).map("".join)
shape = st.one_of(text, st.integers(-3, 10**6), st.floats(allow_nan=True), st.booleans(), st.none(),
                  st.lists(text, max_size=2), st.dictionaries(text, text, max_size=2))
field_value = st.one_of(text, shape)
foreign_recipes = st.fixed_dictionaries(
    {"recipe_version": st.sampled_from(["1", "2", 1, 2.0, "3"]), "container": st.one_of(
        st.sampled_from(["vllm/vllm-openai:cu130-nightly", "vllm-node", "a/b@sha256:" + "0" * 64]), field_value)},
    optional={
        "name": field_value, "description": field_value, "model": st.one_of(st.just("org/model-7b"), field_value),
        "model_revision": field_value, "runtime": st.one_of(st.sampled_from(["vllm", "sglang"]), field_value),
        "command": st.one_of(st.lists(st.one_of(st.sampled_from(
            ["vllm", "serve", "org/model-7b", "--max-model-len", "{max_model_len}", "'{\"a\":1}'", "-tp", "2",
             "--speculative-config", "'{{\"method\":\"mtp\"}}'", "\\\n", "--api-key", "k"]), text), max_size=8)
            .map(" ".join), field_value),
        "defaults": st.one_of(st.dictionaries(st.sampled_from(["max_model_len", "tensor_parallel", "port", "x_y"]),
                                              field_value, max_size=3), field_value),
        "env": st.one_of(st.dictionaries(st.one_of(st.sampled_from(["A", "HF_TOKEN"]), text), field_value,
                                         max_size=2), field_value),
        "mods": st.one_of(st.lists(field_value, max_size=2), field_value),
        "variants": st.one_of(st.dictionaries(st.just("v"), st.dictionaries(text, field_value, max_size=2),
                                              max_size=1), field_value),
    })



def plausible_recipes():
    """Recipes of the right shape whose every free text (name, description, flag values, defaults,
    env values, mods) is hostile: most import, and what is written must be exactly what was read."""
    flags = st.lists(st.tuples(st.sampled_from(["--served-model-name", "--chat-template", "--max-num-seqs",
                                                "--x-y", "--enable-prefix-caching"]), st.one_of(st.none(), text)),
                     max_size=4, unique_by=lambda f: f[0])
    return st.fixed_dictionaries({
        "recipe_version": st.sampled_from(["1", "2"]), "model": st.just("org/model-7b"),
        "container": st.sampled_from(["vllm/vllm-openai:cu130-nightly", "vllm-node", "a/b@sha256:" + "0" * 64]),
        "command": flags.map(lambda fs: "vllm serve {model} -tp {tensor_parallel} " + " ".join(
            f if v is None else f"{f} {shlex.quote(v)}" for f, v in fs)),
        "defaults": st.fixed_dictionaries({"tensor_parallel": st.sampled_from([1, 2, "1"])},
                                          optional={"note": text, "port": st.integers(1, 65535)}),
    }, optional={"name": text, "description": text, "env": st.dictionaries(st.sampled_from(["A", "B_1", "HF_TOKEN"]),
                                                                          text, max_size=3),
                 "mods": st.lists(text, max_size=2), "variants": st.just({"v": {"max_num_seqs": 2}})})


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                HealthCheck.function_scoped_fixture])
@given(doc=st.one_of(foreign_recipes, plausible_recipes()), variant=st.sampled_from([None, "v"]))
@example(doc={"recipe_version": "1", "container": "vllm-node", "name": "a\nimages: []",
              "command": "vllm serve org/model-7b --x '{{\"a\": \"\\n\"}}'"}, variant=None)
def test_generated_foreign_recipes_import_or_are_one_line(tmp_path_factory, doc, variant):
    d = tmp_path_factory.mktemp("imp")
    src = d / "foreign.yaml"
    src.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    out = d / "out.yaml"
    try:
        recipe_import(Context(), str(src), out=str(out), variant=variant)
    except Exit as exc:
        assert exc.code == 1
        if exc.message is not None:  # refused: one line, nothing written
            assert exc.message.startswith("sparkprov: ") and exc.message.isprintable(), exc.message
            assert sorted(p.name for p in d.iterdir()) == ["foreign.yaml"]
            return
    written, _ = load_yaml(out)  # imported (lint errors or not): the file is what the importer built
    assert written == import_file(src, variant=variant).document()
    assert sorted(p.name for p in d.iterdir()) == ["foreign.yaml", "out.yaml"]
    env = written["recipes"][0].get("env", {})
    # the values as read from the foreign file (PyYAML's own dump of `doc` reads a lone NEL back as a space)
    read_env = yaml.safe_load(src.read_text(encoding="utf-8")).get("env") or {}
    assert env == {k: v for k, v in read_env.items() if k != "HF_TOKEN"}
