"""No catalog recipe installs anything when its container starts (issue 26): every recipe of the
catalog, rendered as every container sparkprov would start for it (the single-node server at tp 1;
at its larger tp sizes the Ray head and worker and the native rank 0 and rank 1), and each
container's whole argv searched for `pip install` / `uv pip install`. An install at start needs the
internet on every start and runs unpinned code (G24 only warns).

Today one recipe does (the seed's own launch, 001 §7.3.2): the test is an expected failure naming
it, strict, so it flips when a derived image replaces the install.
"""

from __future__ import annotations

import re

import pytest

from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch
from sparkprov.serving import spec

INSTALL = re.compile(r"\b(?:uv\s+)?pip3?\s+install\b")
# What rendered today installs at start (from the catalog: recipes/001-gemma-nvidia.yaml)
KNOWN = {"nemotron-3-nano-omni"}


def _ctx(host: str, ip: str, name: str, cluster: int) -> HostServeContext:
    return HostServeContext(host=host, host_known=True, model_store="/home/nvidia/vllm",
                            compile_cache="/home/nvidia/vllm-compile-cache",
                            api_key_file="/home/nvidia/.config/sparkprov/api_key", fabric_ifaces=["enp1s0f1np1"],
                            ib_hcas=["rocep1s0f1", "roceP2p1s0f1"], node_ip=ip, cluster_size=cluster,
                            container_name=name)


def rendered_containers():
    """(alias, role, argv) of every container sparkprov would start for every catalog recipe."""
    cat = load_catalog()
    hosts = (("spark1", "192.168.100.11"), ("spark2", "192.168.100.12"))
    for alias in sorted(cat.recipes):
        r = cat.get(alias)
        for tp in r.tp_sizes:
            if tp == 1:
                launch = render_launch(r, _ctx("spark1", hosts[0][1], f"sparkprov-{alias}", 1), 1, catalog=cat)
                yield alias, "server", spec.single(alias, "spark1", launch).argv
                continue
            pair = [(h, ip, render_launch(r, _ctx(h, ip, f"sparkprov-{alias}-{i}", tp), tp, catalog=cat))
                    for i, (h, ip) in enumerate(hosts[:2])]
            for rank, (h, _, launch) in enumerate(pair):
                s = spec.ray_rank(alias, h, launch, rank=rank, nnodes=2, head_ip=hosts[0][1], ray_port=6379)
                yield alias, s.role, s.argv
            for rank, (h, ip, launch) in enumerate(pair):
                s = spec.native_rank(alias, h, launch, rank=rank, nnodes=2, pp=1, master_addr=hosts[0][1],
                                     master_port=29501)
                yield alias, s.role, s.argv


def installs_at_start() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for alias, role, argv in rendered_containers():
        if any(INSTALL.search(w) for w in argv):
            found.setdefault(alias, set()).add(role)
    return found


def test_every_recipe_and_role_renders():
    seen = {(alias, role) for alias, role, _ in rendered_containers()}
    assert {"server", "ray-head", "ray-worker", "rank0", "rank"} <= {role for _, role in seen}
    assert len({alias for alias, _ in seen}) == len(load_catalog().recipes)


def test_the_known_offenders_are_the_ones_that_install():
    # the list the expected failure below names is exactly what renders today
    assert set(installs_at_start()) == KNOWN


@pytest.mark.xfail(strict=True, reason="nemotron-3-nano-omni runs `pip install 'vllm[audio]'` before vllm serve "
                                       "(001 §7.3.2) until a derived image carries it")
def test_no_rendered_container_installs_at_start():
    assert installs_at_start() == {}
