"""Property tests (hypothesis) through the real command line in process: invoke's own Program
parses the argv against the project's tasks.py namespace, as `invoke ...` does, so option parsing,
the task and its error handling all run; only the process is shared (a subprocess per example would
cost ~0.7 s on 2 cores). For the recipe importer and the user recipe loader:
- refused: exit 1, exactly one line on stderr ("sparkprov: ..."), printable, no traceback, nothing
  written (the folder holds what it held);
- accepted: the import writes one file that parses to what the importer built; a user recipe file
  renders (the loader writes nothing).
The strategies are the importer's and the loader's own test strategies (test_recipe_import.py,
test_user_recipe_bounds.py), reused as they are."""

import contextlib
import importlib.util
import io
from pathlib import Path

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from invoke import Program

from sparkprov.catalog.importer import import_file
from sparkprov.yamlpos import load_yaml
from test_recipe_import import foreign_recipes, plausible_recipes
from test_user_recipe_bounds import BASE, user_fields

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sparkprov_tasks", REPO / "tasks.py")
TASKS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TASKS)
SETTINGS = settings(max_examples=30, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def invoke(*argv: str) -> tuple[int, str, str]:
    """`invoke ARGV...` through invoke's Program: (exit code, stdout, stderr). An exception other
    than invoke's Exit would escape here as a traceback does from `invoke`, and fail the test."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            Program(namespace=TASKS.ns, name="sparkprov", binary="invoke").run(["invoke", *argv])
        except SystemExit as exc:
            code = exc.code or 0
    return code, out.getvalue(), err.getvalue()


def assert_one_line_refusal(code: int, out: str, err: str) -> None:
    assert code == 1, (code, out, err)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparkprov: ") and lines[0].isprintable(), err


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@SETTINGS
@given(doc=st.one_of(foreign_recipes, plausible_recipes()), variant=st.sampled_from([None, "v"]))
@example(doc={"recipe_version": "1", "container": "vllm-node", "name": "a\nimages: []",
              "command": "vllm serve org/model-7b --x '{{\"a\": \"\\n\"}}'"}, variant=None)
@example(doc={"recipe_version": "2", "container": ["not", "a", "string"]}, variant=None)
def test_recipe_import_through_the_cli_is_one_line_and_nothing_written_or_a_faithful_file(tmp_path_factory, doc,
                                                                                         variant):
    d = tmp_path_factory.mktemp("imp")
    src, dst = d / "foreign.yaml", d / "out.yaml"
    src.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    argv = ["recipe", "import", "--file", str(src), "--out", str(dst)] + (["--variant", variant] if variant else [])
    code, out, err = invoke(*argv)
    if err.startswith("sparkprov: "):  # refused
        assert_one_line_refusal(code, out, err)
        assert listing(d) == ["foreign.yaml"]
        return
    # imported: exit 0, or 1 with lint errors printed (the file is written to be edited)
    assert code in (0, 1) and "Traceback" not in out + err, (code, out, err)
    assert listing(d) == ["foreign.yaml", "out.yaml"]
    written, _ = load_yaml(dst)
    assert written == import_file(src, variant=variant).document()


@SETTINGS
@given(junk=st.binary(max_size=300))
@example(junk=b"recipe_version: '2'\ncontainer: &a [*a]\n")
@example(junk=b"\xff\xfe")
def test_recipe_import_of_any_bytes_through_the_cli(tmp_path_factory, junk):
    d = tmp_path_factory.mktemp("bytes")
    src = d / "foreign.yaml"
    src.write_bytes(junk)
    code, out, err = invoke("recipe", "import", "--file", str(src), "--out", str(d / "out.yaml"))
    assert "Traceback" not in out + err
    if err.startswith("sparkprov: "):
        assert_one_line_refusal(code, out, err)
        assert listing(d) == ["foreign.yaml"]


@SETTINGS
@given(fields=user_fields, command=st.sampled_from(["recipe", "lint"]))
@example(fields={"mounts": [{"host": "../../../../etc", "container": "/x", "read_only": False}]}, command="recipe")
@example(fields={"model": {"repo": "../../../etc/passwd"}}, command="lint")
def test_user_recipe_file_through_the_cli_is_one_positioned_line_or_renders(tmp_path_factory, fields, command):
    d = tmp_path_factory.mktemp("user")
    path = d / "user.yaml"
    path.write_text(yaml.safe_dump({"recipes": [{**BASE, **fields}]}, sort_keys=False, allow_unicode=True))
    argv = [command, "mine", "--recipes", str(path)] + (["--argv"] if command == "recipe" else [])
    code, out, err = invoke(*argv)
    assert listing(d) == ["user.yaml"]  # the loader writes nothing
    if err.startswith("sparkprov: "):
        assert_one_line_refusal(code, out, err)
        assert err.startswith(f"sparkprov: {path}:"), err  # FILE:LINE:COL
        return
    assert "Traceback" not in out + err
    if command == "recipe":
        assert code == 0 and out.startswith("["), (code, out, err)
    else:
        assert code in (0, 1), (code, out, err)  # lint: findings, errors exit 1
