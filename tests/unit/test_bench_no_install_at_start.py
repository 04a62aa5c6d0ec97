"""No catalog recipe installs anything when its container starts (issue 26): every container of the
golden corpus (tests/fixtures/golden/make.py: every catalog recipe x every layout x every rank, as
cluster-up renders them, the variants, and what `invoke recipe --argv` prints), its whole argv
searched for `pip install` / `uv pip install`. An install at start needs the internet on every start
and runs unpinned code: a recipe's plain pip installs go into a derived image built once instead
(catalog/derive.py, modules/derived_image.py), and that image is what the container runs.
"""

from __future__ import annotations

import re

import pytest

from sparkprov.catalog.derive import baked_requirements, derived_tag, is_derived
from sparkprov.catalog.load import load_catalog
from tests.fixtures.golden import make

INSTALL = re.compile(r"\b(?:uv\s+)?pip3?\s+install\b")


@pytest.fixture(scope="module")
def rendered():
    return make.render_all()


def containers(rendered):
    """(case, argv) of every container of the corpus."""
    for alias, printed in rendered["recipe"].items():
        yield f"recipe {alias}", printed["argv"]
        yield f"recipe {alias} on spark1", printed["host spark1"]["argv"]
    for section in ("deployments", "variants"):
        for case, hosts in rendered[section].items():
            for host, c in hosts.items():
                yield f"{case} on {host}", c["argv"]


def test_the_corpus_covers_every_recipe_and_role(rendered):
    aliases = {k.split(" | ")[0] for k in rendered["deployments"]}
    assert aliases == set(load_catalog().recipes) == set(rendered["recipe"])
    roles = {c["role"] for d in rendered["deployments"].values() for c in d.values()}
    assert roles == {"server", "ray-head", "ray-worker", "rank0", "rank"}


def test_no_rendered_container_installs_at_start(rendered):
    found = [case for case, argv in containers(rendered) if any(INSTALL.search(w) for w in argv)]
    assert found == []


def test_a_recipe_that_pip_installs_runs_its_derived_image(rendered):
    """nemotron-3-nano-omni (001 §7.3.2: `pip install 'vllm[audio]'` before vllm serve): every one of
    its containers runs an image derived from the catalog's with vllm[audio]; its Ray layouts, on an
    image that ships no Ray, one with Ray too."""
    cat = load_catalog()
    installing = {a for a in cat.recipes if baked_requirements(cat.get(a).pre_serve)}
    assert "nemotron-3-nano-omni" in installing
    info = cat.image(cat.get("nemotron-3-nano-omni").image)
    plain = derived_tag(info.pinned, ["vllm[audio]"])
    assert plain in rendered["recipe"]["nemotron-3-nano-omni"]["argv"]
    for case, argv in containers(rendered):
        alias = case.split(" | ")[0].removeprefix("recipe ").split(" on ")[0]
        images = [w for w in argv if is_derived(w)]
        if alias in installing:
            assert len(images) == 1, case
            if "(ray)" in case and info.has_ray is False:
                assert images[0] == derived_tag(info.pinned, ["ray==2.60.0", "vllm[audio]"]), case
            else:
                assert images[0] == plain, case
