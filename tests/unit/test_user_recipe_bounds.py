"""User recipe files confine what a recipe may touch (issue 24): mount host paths are absolute or
under the store and never use '..', a user file's mounts are read-only unless they say otherwise,
model/drafter/staged repos are repo ids and revisions are revisions, docker options are checked by
type. A file that breaks one is one line FILE:LINE:COL through the real `invoke recipe`, exit 1."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from invoke import Context, Exit

from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.models import REPO_ID_RE
from sparkprov.catalog.render import HostServeContext, render_launch
from sparkprov.cli.catalog import recipe
from sparkprov.yamlpos import load_yaml

BASE = {"alias": "mine", "extends": "qwen3.6-27b"}
POSITIONED = re.compile(r"^sparkprov: (?P<file>.+?):(?P<line>\d+):(?P<col>\d+): \S")


def _write(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "user.yaml"
    path.write_text(yaml.safe_dump({"recipes": [{**BASE, **fields}]}, sort_keys=False, allow_unicode=True))
    return path


def _recipe_cli(path: Path, alias: str = "mine") -> str:
    """`invoke recipe ALIAS --recipes FILE --argv`: the docker argv as JSON, or the Exit raised."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        recipe(Context(), alias, recipes=[str(path)], argv=True)
    return out.getvalue()


@pytest.mark.parametrize("fields,at,words", [
    ({"mounts": [{"host": "../../../../etc", "container": "/x", "read_only": False}]}, "mounts.0.host", "'..'"),
    ({"mounts": [{"host": "{model_store}/../../etc", "container": "/x"}]}, "mounts.0.host", "'..'"),
    ({"mounts": [{"host": "/etc:/host-etc", "container": "/x"}]}, "mounts.0.host", "':'"),
    ({"mounts": [{"host": "/data", "container": "/x:rw"}]}, "mounts.0.container", "':'"),
    ({"mounts": [{"host": "/data", "container": "/x/../../etc"}]}, "mounts.0.container", "'..'"),
    ({"mounts": [{"host": "{home}/x", "container": "/x"}]}, "mounts.0.host", "no other {...}"),
    ({"mounts": [{"host": "/data\n--privileged", "container": "/x"}]}, "mounts.0.host", "control character"),
    ({"model": {"repo": "../../../etc/passwd"}}, "model.repo", "not a Hugging Face repo id"),
    ({"model": {"repo": "org/name", "revision": "main\n--privileged"}}, "model.revision", "not a branch"),
    ({"model": {"repo": "org/name", "local_dir": "x", "path": "models/x"}}, "model.path", "absolute"),
    ({"extra_repos": [{"repo": "../drafter", "purpose": "drafter"}]}, "extra_repos.0.repo", "repo id"),
    ({"stage": [{"repo": "a/../b", "filename": "f.py", "dest": "f.py"}]}, "stage.0.repo", "repo id"),
    ({"docker": {"shm_size": "1g --privileged"}}, "docker.shm_size", "not a size"),
    ({"docker": {"ulimits": ["memlock=-1 --privileged"]}}, "docker.ulimits", "NAME=SOFT[:HARD]"),
    ({"image": "vllm/vllm-openai:nightly\n"}, "image", "not a reference"),
])
def test_a_recipe_that_leaves_its_bounds_is_one_positioned_line(tmp_path, fields, at, words):
    path = _write(tmp_path, **fields)
    with pytest.raises(Exit) as err:
        _recipe_cli(path)
    msg = err.value.message
    assert err.value.code == 1 and msg.isprintable() and len(msg.splitlines()) == 1, msg
    m = POSITIONED.match(msg)
    assert m and m["file"] == str(path), msg
    _, pos = load_yaml(path)
    path_at = ("recipes", 0, *[int(p) if p.isdigit() else p for p in at.split(".")])
    assert (int(m["line"]), int(m["col"])) in (pos.at(path_at), pos.at(path_at, key=True)), (msg, at)
    assert words in msg


def test_a_user_mount_is_read_only_unless_it_says_so(tmp_path):
    path = _write(tmp_path, mounts=[{"host": "/data/a", "container": "/a"},
                                    {"host": "plugins", "container": "/b", "read_only": False},
                                    {"host": "{model_store}/c", "container": "/c", "read_only": True}])
    cat = load_catalog([path])
    store = "/srv/store"
    launch = render_launch(cat.get("mine"), HostServeContext(model_store=store), 1, catalog=cat)
    mounts = {m.container: (m.host, m.read_only) for m in launch.mounts}
    assert mounts["/a"] == ("/data/a", True)
    assert mounts["/b"] == (f"{store}/plugins", False)  # relative: under the store
    assert mounts["/c"] == (f"{store}/c", True)
    catalog_rw = [m for r in load_catalog().recipes.values() for m in r.mounts if not m.read_only]
    assert catalog_rw  # the catalog's own files keep their defaults (they say what they mount)


# -- generated user recipes through `invoke recipe` ---------------------------------------------------

NASTY = ["..", "../", "/", ":", ",", "{model_store}", "{model_dir}", "{x}", "\n", "\x00", " --privileged", "$(id)",
         "~", "etc", "passwd", "-", "=", "g", "1", "ro", "rw", "\u2028", "é"]
piece = st.one_of(st.sampled_from(NASTY), st.text(max_size=3))
hostile = st.lists(piece, min_size=1, max_size=6).map("".join)
user_fields = st.fixed_dictionaries({}, optional={
    "mounts": st.lists(st.fixed_dictionaries({"host": hostile, "container": hostile.map(lambda s: "/" + s)},
                                             optional={"read_only": st.booleans()}), max_size=2),
    "model": st.fixed_dictionaries({"repo": st.one_of(hostile, st.just("org/name"))},
                                   optional={"revision": hostile}),
    "docker": st.fixed_dictionaries({}, optional={"shm_size": hostile, "ulimits": st.lists(hostile, max_size=2)}),
    "extra_repos": st.lists(st.fixed_dictionaries({"repo": hostile, "purpose": st.just("drafter")}), max_size=1),
})


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                HealthCheck.function_scoped_fixture])
@given(fields=user_fields)
@example(fields={"mounts": [{"host": "a/../../b", "container": "/x"}]})
@example(fields={"mounts": [{"host": "{model_store}/plugins", "container": "/p"}], "docker": {"shm_size": "16gb"}})
def test_generated_user_recipes_load_within_bounds_or_are_one_line(tmp_path_factory, fields):
    path = _write(tmp_path_factory.mktemp("user"), **fields)
    try:
        argv = _recipe_cli(path)
    except Exit as exc:
        assert exc.code == 1 and exc.message.startswith("sparkprov: ") and exc.message.isprintable(), exc.message
        assert len(exc.message.splitlines()) == 1
        return
    r = load_catalog([path]).get("mine")  # accepted: everything it touches stays within bounds
    for m in r.mounts:
        assert ".." not in m.host.split("/") and ":" not in m.host + m.container
        assert m.read_only or (m.model_fields_set and "read_only" in m.model_fields_set)
    assert REPO_ID_RE.match(r.model.repo) and all(REPO_ID_RE.match(x.repo) for x in r.extra_repos)
    assert r.docker.shm_size is None or " " not in r.docker.shm_size
    assert argv.startswith("[")
