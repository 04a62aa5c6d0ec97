"""Every serving command sparkprov renders, against the golden file (tests/fixtures/golden/make.py
says how it was made): the `docker run` argv, environment, labels and recipe hash of every catalog
recipe x layout x rank, and what `invoke recipe --argv` prints. A running container whose recipe
hash label equals its case's is left running by cluster-up: a difference here replaces it."""

from __future__ import annotations

import difflib
import json

import pytest

from tests.fixtures.golden import make

GOLDEN = json.loads(make.OUT.read_text())


@pytest.fixture(scope="module")
def rendered():
    return make.render_all()


def _diff(want, got) -> str:
    a = json.dumps(want, indent=1, sort_keys=True).splitlines()
    b = json.dumps(got, indent=1, sort_keys=True).splitlines()
    return "\n".join(list(difflib.unified_diff(a, b, "golden", "rendered", lineterm=""))[:60])


@pytest.mark.parametrize("section", ["recipe", "deployments", "variants"])
def test_every_case_renders_as_recorded(rendered, section):
    assert sorted(rendered[section]) == sorted(GOLDEN[section])
    for key, want in GOLDEN[section].items():
        assert rendered[section][key] == want, f"{section} {key!r}:\n{_diff(want, rendered[section][key])}"


def test_the_golden_file_covers_every_recipe_and_role():
    aliases = {k.split(" | ")[0] for k in GOLDEN["deployments"]}
    assert aliases == set(GOLDEN["recipe"])
    roles = {(c["role"], c["labels"].get("sparkprov.executor")) for d in GOLDEN["deployments"].values()
             for c in d.values()}
    assert roles == {("server", None), ("ray-head", "ray"), ("ray-worker", "ray"), ("rank0", "native"),
                     ("rank", "native")}
    assert all(c["labels"]["sparkprov.recipe_hash"] == c["hash"] for d in GOLDEN["deployments"].values()
               for c in d.values())
