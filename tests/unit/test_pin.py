"""cluster-up --pin (issue 26) on literal data: the registry digest each node's image play exports,
the comparison across the nodes and its refusals, the reference by digest in the container (and so
its recipe hash: a rerun is a no-op, another digest a new hash), G4 quiet for a pinned deployment,
the option's parse, and what the history records of a pinned start."""

from __future__ import annotations

import json

import pytest

from sparkprov.catalog.lint import WARNING, lint_launch
from sparkprov.options import OptionError
from sparkprov.facts.serving import ImageDigests
from sparkprov.imageref import ImageRef
from sparkprov.modules import deployment_history as dh
from sparkprov.modules import docker_image
from sparkprov.serving import history, node
from sparkprov.serving.deployment import Deployment
from tests.fixtures.golden import make as golden
from tests.unit.test_serving_modules import SMI, container_play, containers, ctx, fabric, run

IMG = "nvcr.io/nvidia/vllm:26.04-py3"
D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
ID1, ID2 = "sha256:" + "a" * 64, "sha256:" + "b" * 64
DEP = {"name": "nat", "model": "llama-3.3-70b", "hosts": ["spark1", "spark2"], "tp": 2, "executor": "native",
       "pin": True}
PREFLIGHT = {"spark1": {"serve_preflight": {"nat": {"node_ip": "192.168.100.11", "rail_net": "192.168.100.0/24"}}},
             "spark2": {"serve_preflight": {"nat": {"node_ip": "192.168.100.12", "rail_net": "192.168.100.0/24"}}}}


# -- the reference by digest, and the comparison across nodes ----------------------------------------

@pytest.mark.parametrize("ref,want", [
    (IMG, f"nvcr.io/nvidia/vllm@{D1}"),
    ("vllm/vllm-openai:nightly", f"vllm/vllm-openai@{D1}"),
    ("docker.io/library/ubuntu:24.04", f"ubuntu@{D1}"),           # as docker names it in RepoDigests
    ("registry.example:5000/vllm:next", f"registry.example:5000/vllm@{D1}"),
    (f"registry.example/vllm:next@{D2}", f"registry.example/vllm:next@{D2}"),  # a digest already: its own pin
])
def test_pinned_ref_is_the_repository_by_digest(ref, want):
    assert ImageRef.parse(ref).by_digest(D1) == want


def test_nodes_holding_one_digest_pin_it():
    digest, problems = node.pin_digest(IMG, {"spark1": (ID1, D1), "spark2": (ID1, D1)}, "spark1")
    assert digest == D1 and problems == []
    image = node.node_image(Deployment.model_validate(DEP), digest)
    assert image.requested == IMG and image.runs == f"nvcr.io/nvidia/vllm@{D1}" and image.why == "pinned"
    assert node.node_image(Deployment.model_validate(DEP)).runs == IMG  # no digest known yet: the reference


def test_a_node_that_holds_no_image_yet_is_left_out():
    # check mode: the image play would pull it on spark2; spark1's digest is the one to run
    assert node.pin_digest(IMG, {"spark1": (ID1, D1), "spark2": (None, None)}, "spark2") == (D1, [])
    assert node.pin_digest(IMG, {"spark1": (None, None)}, "spark1") == (None, [])


def test_a_node_whose_image_has_no_registry_digest_is_refused_by_name():
    _, problems = node.pin_digest(IMG, {"spark1": (ID1, D1), "spark2": (ID1, None)}, "spark1")
    assert problems == [f"spark2: {IMG} on spark2 has no registry digest (built or loaded there, never pulled): "
                        f"--pin cannot pin it (fix: docker pull {IMG} on spark2, then cluster-up --pin again; "
                        "or leave out --pin)"]


def test_nodes_with_different_digests_are_refused_naming_each():
    pinned, problems = node.pin_digest(IMG, {"spark1": (ID1, D1), "spark2": (ID2, D2)}, "spark2")
    assert pinned is None
    assert problems == [f"spark2: the nodes hold different registry digests of {IMG}: spark1 {D1}, spark2 {D2} "
                        f"(--pin) (fix: docker pull {IMG} on every node so they hold one build, or --image "
                        "nvcr.io/nvidia/vllm@sha256:... naming the one to run)"]


# -- what the image play exports ----------------------------------------------------------------------

def test_image_digests_fact_reads_the_repositorys_digest():
    out = f"SPARKPROV_DIGEST {IMG} {D1}\nSPARKPROV_DIGEST {IMG} {D2}\n"
    assert ImageDigests((IMG,)).parse(out, "", 0) == {IMG: D1}


@pytest.mark.parametrize("image,digests,want", [
    (IMG, {IMG: D1}, {"images": {IMG: ID1}, "image_digests": {IMG: D1}}),
    (IMG, {}, {"images": {IMG: ID1}}),  # built or loaded here: no digest to export
    (f"nvcr.io/nvidia/vllm@{D2}", {}, {"images": {f"nvcr.io/nvidia/vllm@{D2}": ID1},
                                       "image_digests": {f"nvcr.io/nvidia/vllm@{D2}": D2}}),
])
def test_the_image_play_exports_the_digest_it_holds(image, digests, want):
    p = run(docker_image.DockerImage, {"image": image}, {"image": {"id": ID1, "error": None}, "digests": digests},
            ctx())
    assert p.failed is None and not p.changes and p.exports == want


# -- the container, pinned ----------------------------------------------------------------------------

def held(d1=D1, d2=D1, id2=ID1):
    out = {h: dict(e) for h, e in PREFLIGHT.items()}
    for h, image_id, digest in (("spark1", ID1, d1), ("spark2", id2, d2)):
        out[h]["images"] = {IMG: image_id}
        if digest:
            out[h]["image_digests"] = {IMG: digest}
    return out


def start(exports, dep=DEP, running=()):
    values = {"containers": containers(*running), "smi": SMI, "ollama": {"models": []}, "fabric": fabric("spark1")}
    return container_play({"deployment": dep, "drop_caches": False}, values, ctx("spark1", exports))


def test_a_pinned_rank_runs_by_digest_and_a_rerun_changes_nothing():
    p = start(held())
    (change,) = p.changes
    assert f" nvcr.io/nvidia/vllm@{D1} " in change.script and IMG not in change.script
    labels = change.predicts[0][1]["containers"][0]["labels"]
    running = {"name": "sparkprov-nat-rank0", "id": "c" * 64, "status": "running", "labels": labels}
    again = start(held(), running=[running])
    assert not again.changes and again.exports["containers"]["nat"]["hash"] == labels["sparkprov.recipe_hash"]


def test_the_recipe_hash_changes_with_the_digest_only():
    def hash_of(exports, dep=DEP):
        return start(exports, dep).changes[0].predicts[0][1]["containers"][0]["labels"]["sparkprov.recipe_hash"]

    assert hash_of(held()) == hash_of(held())
    assert hash_of(held(D2, D2)) != hash_of(held())
    unpinned = {k: v for k, v in DEP.items() if k != "pin"}
    assert hash_of(held(), unpinned) != hash_of(held())  # pinning a running deployment replaces it once


def test_the_golden_pinned_cases_run_by_digest():
    variants = json.loads(golden.OUT.read_text())["variants"]
    for host in ("spark1", "spark2"):
        assert f"nvcr.io/nvidia/vllm@{golden.PIN_DIGEST}" in variants["llama-3.3-70b | pinned-tp2"][host]["argv"]
    assert f"vllm/vllm-openai@{golden.PIN_DIGEST}" in variants["qwen3.6-27b | pinned"]["spark1"]["argv"]
    # --image carrying a digest is its own pin: run as given
    assert f"registry.example/vllm:next@{golden.PIN_DIGEST}" in variants["lab-tiny | pinned-image"]["spark1"]["argv"]


@pytest.mark.parametrize("exports,words", [
    (held(D1, D2, ID2), ["spark1 " + D1, "spark2 " + D2, "different registry digests"]),
    (held(D1, None), ["spark2: " + IMG + " on spark2 has no registry digest", "docker pull"]),
])
def test_every_node_refuses_before_any_rank_starts(exports, words):
    for h in ("spark1", "spark2"):
        values = {"containers": containers(), "smi": SMI, "ollama": {"models": []}, "fabric": fabric(h)}
        p = container_play({"deployment": DEP, "checks_only": True}, values, ctx(h, exports))
        assert p.failed and all(w in p.failed for w in words), p.failed
        assert not p.changes


def test_the_start_checks_name_the_pin():
    values = {"containers": containers(), "smi": SMI, "ollama": {"models": []}, "fabric": fabric("spark2")}
    p = container_play({"deployment": DEP, "checks_only": True}, values, ctx("spark2", held()))
    assert p.failed is None and p.msg.endswith(f"pinned to nvcr.io/nvidia/vllm@{D1}")


# -- G4, the option, the record -----------------------------------------------------------------------

def test_G4_unpinned_tag_warning_is_quiet_for_a_pinned_deployment():
    dep = Deployment.model_validate({"name": "q", "model": "qwen3.6-27b", "hosts": ["spark1"]})
    launch = node.launch(dep, "spark1", {}, "/home/nvidia", None, SMI)
    cat = node.catalog_for(dep)
    g4 = [f for f in lint_launch(launch, catalog=cat) if f.rule == "G4" and f.severity == WARNING]
    assert len(g4) == 1 and "moving tag" in g4[0].message and "cluster-up --pin" in g4[0].fix
    assert not [f for f in lint_launch(launch, catalog=cat, pinned=True) if f.rule == "G4"]
    assert any("G4" in w for w in node.lint_problems(launch, dep)[1])
    pinned = dep.model_copy(update={"pin": True})
    assert not any("G4" in w for w in node.lint_problems(launch, pinned)[1])


def test_pin_option_marks_every_deployment_and_their_arguments():
    from sparkprov.cli.cluster import apply_pin_option

    deps = [Deployment(name="a", model="lab-tiny", hosts=["spark1"]),
            Deployment(name="b", model="llama-3.3-70b", hosts=["spark1", "spark2"], tp=2, executor="native")]
    assert "pin" not in deps[0].as_args() and "pin" not in dh.spec_of(deps[0])  # unpinned: as before --pin
    apply_pin_option(deps)
    assert all(d.pin and d.as_args()["pin"] is True and dh.spec_of(d)["pin"] is True for d in deps)


def test_pin_option_refuses_a_ray_image_cluster_up_builds_in_one_line():
    from sparkprov.cli.cluster import apply_pin_option

    dep = Deployment(name="r", model="llama-3.3-70b", hosts=["spark1", "spark2"], tp=2)  # Ray on NGC: derived
    with pytest.raises(OptionError) as e:
        apply_pin_option([dep])
    line = e.value.line()
    assert "\n" not in line and line.startswith("--pin: deployment 'r' runs the Ray image cluster-up builds from "
                                                f"{IMG} on rank 0") and "--executor native" in line
    assert dep.pin is False


def test_the_history_records_the_digest_a_pinned_node_runs():
    pinned = f"nvcr.io/nvidia/vllm@{D1}"
    c = {"name": "sparkprov-nat-rank0", "id": "c" * 64, "image": pinned, "image_id": ID1, "recipe_hash": "r",
         "status": "running"}
    entry = history.node_entry("spark1", [c], {ID1: []})  # RepoDigests aside: the reference is the digest
    assert entry["image"] == pinned and entry["digest"] == pinned


STAND_IN_DOCKER = """#!/bin/sh
# docker as the image play meets it: the image is absent until `docker pull` fetched it
case "$1 $2" in
  "image inspect")
    [ -f "$PULLED" ] || { echo "Error: No such image: $5" >&2; exit 1; }
    case "$4" in
      *RepoDigests*) echo "sparkprov/lab-vllm-cpu@sha256:%s" ;;
      *) echo "sha256:%s" ;;
    esac ;;
  "pull -q") touch "$PULLED"; echo "docker.io/$3" ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac
""" % ("7" * 64, "3" * 64)


def test_an_image_pulled_in_this_run_exports_its_digest(tmp_path, monkeypatch):
    """Found in the lab (a fresh spark2, cluster-up --pin of a TP 2 deployment): the node that pulled
    the image in this run was refused as holding no registry digest, because the pull touched only
    the image-ID fact and the play's exports came from the digests read before the pull. The
    engine on this machine, with a stand-in docker on PATH (docker is not ours)."""
    import io
    import os
    from pathlib import Path as P

    from sparkprov.data.inventory import load_inventory
    from sparkprov.data.playbook import load_playbook
    from sparkprov.engine.report import Report
    from sparkprov.engine.run import Runner, RunOptions

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(STAND_IN_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PULLED", str(tmp_path / "pulled"))
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  first: {connection: local}\n")
    book = tmp_path / "image.yaml"
    book.write_text("- name: image\n  hosts: all\n  tasks:\n    - name: get it\n"
                    "      docker_image: {image: 'sparkprov/lab-vllm-cpu:0.32.0', source: registry}\n")
    inventory = load_inventory(inv)
    runner = Runner(inventory, load_playbook(book), ["first"], RunOptions(), Report(io.StringIO()))
    runner.run()
    assert P(tmp_path / "pulled").exists() and runner.report.exit_code() == 0
    assert docker_image.IMAGE_DIGESTS.read(runner.exports, "first") == {
        "sparkprov/lab-vllm-cpu:0.32.0": "sha256:" + "7" * 64}
