"""Values between plays (modules/base.py Export): each declared once beside the module that produces
it, read through its declaration, never by a key spelled out, so that renaming one fails here (or
at import), not on a Spark. The stored value is the plain dict or list it always was."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import sparkprov.modules
from sparkprov.modules.base import Export, HostContext
from sparkprov.modules.fabric import FABRIC
from sparkprov.modules.serve_bench import BENCH_MEMBER
from sparkprov.modules.ssh_mesh import SSH_MESH

ROOT = Path(sparkprov.modules.__file__).resolve().parents[1]

def test_no_reader_indexes_the_exports_by_a_literal_key():
    # `.exports.get(` / `exports={"`: a key spelled out where its declaration should be read
    literal = re.compile(r"""exports\.get\(|exports=\{["']|exports = \{["']|\.get\((PREFLIGHT|EXPORT|RAILS|IMAGES)\)""")
    allowed = {"modules/base.py", "engine/run.py"}   # the declaration itself, and the engine that stores
    found = []
    for py in ROOT.rglob("*.py"):
        rel = py.relative_to(ROOT).as_posix()
        if rel.startswith("lab/") or rel in allowed:
            continue
        for n, line in enumerate(py.read_text().splitlines(), 1):
            if literal.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == []


def test_a_key_declared_again_in_another_module_fails_at_import():
    namespace = {"__name__": "sparkprov.modules.some_other", "Export": Export}
    with pytest.raises(ValueError, match="'fabric' is declared in sparkprov.modules.fabric and again in "
                                         "sparkprov.modules.some_other"):
        exec("Export('fabric', dict)", namespace)


def test_a_declaration_reads_the_value_stored_as_it_was_written():
    fabric = {"rails": [], "node_ip": None, "nccl_socket_ifname": None, "gloo_socket_ifname": None,
              "ucx_net_devices": None, "nccl_ib_hca": None, "converged": True}
    exports = {"spark1": {**FABRIC(fabric), **SSH_MESH({"peers": {}, "converged": False, "digest": "d"})},
               "spark2": {}, "spark3": BENCH_MEMBER({"rank": "1"})}
    assert exports["spark1"]["fabric"] is fabric  # what the old readers index
    assert FABRIC.read(exports, "spark1") is fabric
    assert FABRIC.read(exports, "spark2") is None and FABRIC.read(exports, "nowhere") is None
    assert FABRIC.of(exports["spark1"]) is fabric
    assert FABRIC.by_host(exports) == {"spark1": fabric}
    assert BENCH_MEMBER.by_host(exports, ["spark3", "spark1"]) == {"spark3": {"rank": "1"}}
    # one entry of it (a deployment's, an image's, a field's): None where the host exported none
    assert FABRIC.entry(exports, "spark1", "converged") is True and SSH_MESH.entry(exports, "spark1", "digest") == "d"
    assert FABRIC.entry(exports, "spark2", "converged") is None and FABRIC.entry(exports, "spark1", "nothing") is None


def test_of_play_reads_the_hosts_of_the_play_only():
    exports = {h: FABRIC({"converged": h != "spark2"}) for h in ("spark1", "spark2", "spark3")}
    host = HostContext("spark1", {}, {}, check=True, exports=exports, play_hosts=["spark1", "spark2"], become=False)
    assert FABRIC.of_play(host) == {"spark1": {"converged": True}, "spark2": {"converged": False}}
    # while the engine gathers a play's facts it passes no play hosts yet: every host of the run counts
    host.play_hosts = []
    assert sorted(FABRIC.of_play(host)) == ["spark1", "spark2", "spark3"]
