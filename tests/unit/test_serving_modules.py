"""The serving modules' plans on literal facts: what cluster-up, cluster-down and status decide,
before any host is touched (the lab suite runs the same modules on hosts)."""

from __future__ import annotations

import pytest

from sparkprov.facts import fabric as fabric_facts
from sparkprov.modules import (allreduce, deployment_health, docker_image, node_container, serve_absent,
                               serve_preflight, vllm_container, vllm_ready)
from sparkprov.modules.base import FactView, HostContext
from sparkprov.serving import node
from sparkprov.serving.deployment import Deployment
from sparkprov.staging.plan import StoreFacts

HOME = "/home/nvidia"
REPO_FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures"
DEP = {"name": "tp", "model": "llama-3.3-70b", "hosts": ["spark1", "spark2"], "tp": 2}
RAILS = {h: [{"iface": "enp1s0f1np1", "address": f"192.168.100.1{i}", "prefix": 24, "subnet": "192.168.100.0/24",
              "hca": "rocep1s0f1", "mtu": 9000, "up": True}] for i, h in ((1, "spark1"), (2, "spark2"))}
SMI = {"present": True, "gpus": [{"name": "NVIDIA GB10"}], "driver_version": "580.95.05", "cuda_version": "13.0",
       "error": None}
MEM = {"MemTotal": 128 * 2**30, "MemAvailable": 120 * 2**30, "Cached": 2 * 2**30}


def ctx(host="spark1", exports=None, check=False):
    return HostContext(host, {}, {"user": "nvidia", "home": HOME}, check=check, exports=exports or {},
                       play_hosts=["spark1", "spark2"], become=False)


def run(module_cls, args, values, host):
    m = module_cls()
    a = m.Args.model_validate(args)
    facts = {f.key: values[name] for name, f in m.needs(a, host).items() if name in values}
    return m.plan(a, m.view(a, FactView(facts, {}), host), host)


def container_play(args, values, host):
    """What a container play of cluster-up plans on one host (plays/serve.py): node_container builds the
    node's container from its facts and the exports before (its failure is the play's), then
    vllm_container, the next task, compares it with what runs there."""
    built = run(node_container.BuildNodeContainer, {"deployment": args["deployment"]}, values, host)
    if built.failed is not None:
        return built
    exports = {**host.exports, host.name: {**host.exports.get(host.name, {}), **built.exports}}
    return run(vllm_container.VllmContainer, args, values,
               HostContext(host.name, host.vars, host.info, check=host.check, exports=exports,
                           play_hosts=host.play_hosts, become=host.become))


def fabric(host):
    return {"rails": RAILS[host], **fabric_facts.nccl_settings(RAILS[host])}


def staged_store(dep_args=None):
    """A store holding the deployment's weights, verified (as stage-weights leaves it)."""
    from sparkprov.staging.plan import Entry, Record

    dep = Deployment.model_validate(dep_args or DEP)
    (repo, rev), = node.repos(dep)
    base = "hub/models--" + repo.replace("/", "--")
    commit = "c" * 40
    entries, verified = {}, {}
    for name in ("config.json", "model.safetensors"):
        blob = f"{base}/blobs/{name}-sha"
        entries[blob] = Entry("f", 10, 1, "")
        entries[f"{base}/snapshots/{commit}/{name}"] = Entry("l", 0, 1, f"../../blobs/{name}-sha")
        verified[blob] = Record(10, 1, "sha256:x")
    return StoreFacts(store=f"{HOME}/vllm", entries=entries, verified=verified, refs={f"{base}/refs/{rev}": commit})


def containers(*items):
    return {"access": True, "error": None, "containers": list(items)}


def preflight_values(host, **kw):
    return {"smi": SMI, "fabric": fabric(host), "mem": MEM, "ollama": {"models": []}, "containers": containers(),
            "listening": [], "store": staged_store(), "qualification": {"present": False}, **kw}


def test_preflight_passes_and_exports_the_fabric_address():
    p = run(serve_preflight.ServePreflight, {"deployment": DEP}, preflight_values("spark1"), ctx())
    assert p.failed is None, p.failed
    assert p.exports == {"serve_preflight": {"tp": {"node_ip": "192.168.100.11", "rail_net": "192.168.100.0/24",
                                                    "rails": ["192.168.100.11"]}}}


def test_preflight_names_missing_weights_a_busy_port_and_no_rail():
    empty = StoreFacts(store=f"{HOME}/vllm")
    p = run(serve_preflight.ServePreflight, {"deployment": DEP},
            preflight_values("spark1", store=empty, listening=[8000], fabric={"rails": []}), ctx())
    assert "weights not staged" in p.failed and "stage-weights llama-3.3-70b" in p.failed
    assert "port 8000 is already in use" in p.failed and "G32" in p.failed


def test_image_present_is_exported_absent_is_pulled_then_copied_from_a_peer():
    args = {"image": "img:1", "peers": ["spark1", "spark2"], "deployment": "tp"}
    ok = run(docker_image.DockerImage, args, {"image": {"id": "sha256:abc", "error": None}, "digests": {}}, ctx())
    assert not ok.changes and ok.exports == {"images": {"img:1": "sha256:abc"}}
    exports = {"spark1": {"serve_preflight": {"tp": {"node_ip": "192.168.100.11"}}}}
    p = run(docker_image.DockerImage, args, {"image": {"id": None, "error": None}, "digests": {}}, ctx("spark2", exports))
    (change,) = p.changes
    assert "docker pull -q img:1" in change.script
    assert "nvidia@192.168.100.11 docker save img:1 | docker load" in change.script  # over the fabric, from the peer
    assert "spark2" not in change.script.split("docker pull")[1]  # never from itself


def test_container_started_with_the_cache_drop_as_root_then_a_noop():
    exports = {"spark1": {"serve_preflight": {"tp": {"node_ip": "192.168.100.11", "rail_net": "192.168.100.0/24"}}}}
    values = {"containers": containers(), "smi": SMI, "ollama": {"models": []}, "fabric": fabric("spark1")}
    p = container_play({"deployment": DEP}, values, ctx(exports=exports))
    drop, start = p.changes
    assert drop.become is True and "drop_caches" in drop.script
    assert start.become is None and "docker run -d --name sparkprov-tp-head" in start.script
    labels = start.predicts[0][1]["containers"][0]["labels"]
    running = {"name": "sparkprov-tp-head", "id": "h" * 64, "status": "running", "labels": labels}
    again = container_play({"deployment": DEP}, {**values, "containers": containers(running)},
                ctx(exports=exports))
    assert not again.changes and again.exports["containers"]["tp"]["id"] == "h" * 64


def test_a_worker_follows_rank0s_container():
    base = {"spark1": {"serve_preflight": {"tp": {"node_ip": "192.168.100.11", "rail_net": "192.168.100.0/24"}}},
            "spark2": {"serve_preflight": {"tp": {"node_ip": "192.168.100.12", "rail_net": "192.168.100.0/24"}}}}
    values = {"containers": containers(), "smi": SMI, "ollama": {"models": []}, "fabric": fabric("spark2")}
    hashes = []
    for rank0 in ("a" * 64, "b" * 64):
        exports = {**base, "spark1": {**base["spark1"], "containers": {"tp": {"id": rank0}}}}
        p = container_play({"deployment": DEP, "drop_caches": False}, values, ctx("spark2", exports))
        hashes.append(p.changes[0].predicts[0][1]["containers"][0]["labels"]["sparkprov.recipe_hash"])
    assert hashes[0] != hashes[1]


def test_a_node_container_is_built_from_literal_inputs():
    """serving/node.py build, what node_container hands vllm_container: a Ray worker that serves no API,
    its recipe hash following rank 0's container, refused while rank 0 exported no fabric address."""
    dep = Deployment.model_validate(DEP)
    inputs = {"vars": {}, "home": HOME, "fabric": fabric("spark2"), "smi": SMI, "head_ip": "192.168.100.11"}
    built, problems = node.build(dep, node.NodeInputs("spark2", **inputs))
    assert problems == [] and built.spec.name == "sparkprov-tp-worker" and not built.serves
    assert built.image == node.node_image(dep) and built.image.runs in built.spec.argv
    later, _ = node.build(dep, node.NodeInputs("spark2", **inputs, rank0_id="a" * 64))
    assert later.spec.hash != built.spec.hash
    none, problems = node.build(dep, node.NodeInputs("spark2", **{**inputs, "head_ip": None}))
    assert none is None and problems == ["spark2: rank 0 (spark1) exported no fabric address (its preflight failed)"]


def test_vllm_container_starts_nothing_without_a_built_container():
    """The container task without node_container before it (a playbook that left it out) fails, naming it."""
    p = run(vllm_container.VllmContainer, {"deployment": DEP}, {"containers": containers(), "ollama": {"models": []}},
            ctx())
    assert p.failed == "spark1: no container was built for tp (node_container runs before vllm_container)"
    assert not p.changes


def test_worker_on_another_subnet_fails_naming_G33_before_anything_is_copied_or_started():
    """The preflight's group phase, a play after every node's preflight (before the image play,
    whose copy from rank 0 runs over the fabric): the rank off rank 0's subnet fails, rank 0 passes."""
    exports = {"spark1": {"serve_preflight": {"tp": {"node_ip": "192.168.100.11", "rail_net": "192.168.100.0/24"}}},
               "spark2": {"serve_preflight": {"tp": {"node_ip": "192.168.200.12", "rail_net": "192.168.200.0/24"}}}}
    group = {"deployment": DEP, "phase": "group"}
    p = run(serve_preflight.ServePreflight, group, {}, ctx("spark2", exports))
    assert "192.168.200.12 is not on rank 0's subnet 192.168.100.0/24" in p.failed and "G33" in p.failed, p.failed
    ok = run(serve_preflight.ServePreflight, group, {}, ctx("spark1", exports))
    assert ok.failed is None and not ok.changes
    assert serve_preflight.ServePreflight().needs(serve_preflight.Args.model_validate(group), ctx()) == {}


def test_the_start_checks_run_alone_on_every_node_before_rank0_starts():
    """checks_only (the 'ranks can start' play): the same checks as a start, no change."""
    base = {"spark1": {"serve_preflight": {"tp": {"node_ip": "192.168.100.11", "rail_net": "192.168.100.0/24"}}},
            "spark2": {"serve_preflight": {"tp": {"node_ip": "192.168.100.12", "rail_net": "192.168.100.0/24"}}}}
    values = {"containers": containers(), "smi": SMI, "ollama": {"models": []}, "fabric": fabric("spark2")}
    ok = container_play({"deployment": DEP, "checks_only": True}, values, ctx("spark2", base))
    assert ok.failed is None and not ok.changes and "can start its rank" in ok.msg
    ref = node.node_image(Deployment.model_validate(DEP)).requested
    builds = {**base, "spark1": {**base["spark1"], "images": {ref: "sha256:a"}},
              "spark2": {**base["spark2"], "images": {ref: "sha256:b"}}}
    bad = container_play({"deployment": DEP, "checks_only": True}, values, ctx("spark2", builds))
    assert "different builds" in bad.failed and "G34" in bad.failed and not bad.changes


def test_replacing_counts_the_replaced_deployments_port_and_memory_as_free():
    """cluster-up --replace: the deployment serving on the port is removed before the new one starts,
    so the preflight (and --check) does not refuse the port it holds, nor the memory it holds."""
    one = {"deployment": DEP}
    other = {"name": "sparkprov-two", "id": "t" * 64, "status": "running",
             "labels": {"sparkprov.deployment": "two", "sparkprov.port": "8000", "sparkprov.managed": "1"}}
    short = {"MemTotal": 128 * 2**30, "MemAvailable": 20 * 2**30, "Cached": 1 * 2**30}
    values = preflight_values("spark1", containers=containers(other), listening=[8000], mem=short)
    refused = run(serve_preflight.ServePreflight, one, values, ctx())
    assert "container sparkprov-two of deployment 'two' holds port 8000" in refused.failed, refused.failed
    assert "available" in refused.failed  # and its memory
    made_room = run(serve_preflight.ServePreflight, {**one, "replacing": ["two"]}, values, ctx())
    assert made_room.failed is None, made_room.failed


def ready(status="running", health=200, smoke=None):
    return {"ready": {"id": "c" * 64, "status": status, "restarts": 0, "health": health, "models": ["m"],
                      "smoke": smoke, "logs": "engine died: lost rank 1"}, "fabric": fabric("spark1")}


def test_ready_smoke_tests_once_per_container_and_judges_the_answer():
    p = run(vllm_ready.VllmReady, {"deployment": DEP}, ready(health=None), ctx())
    (change,) = p.changes
    assert change.outcome is not None and "ray_gpus" in change.script and change.timeout > 300
    ok = run(vllm_ready.VllmReady, {"deployment": DEP},
             ready(smoke={"status": 200, "content": "12*17 = 204", "finish": "stop"}), ctx())
    assert not ok.changes and ok.failed is None and "smoke test passed" in ok.msg
    bad = run(vllm_ready.VllmReady, {"deployment": DEP},
              ready(smoke={"status": 200, "content": "!!!!!!!!", "finish": "length"}), ctx())
    assert bad.failed and "smoke test" in bad.failed
    dead = run(vllm_ready.VllmReady, {"deployment": DEP}, ready(status="exited"), ctx())
    assert "is exited" in dead.failed and "lost rank 1" in dead.failed


def test_absent_removes_only_sparkprov_containers_of_the_named_deployment():
    cs = containers({"name": "sparkprov-tp-head", "labels": {"sparkprov.deployment": "tp"}},
                    {"name": "sparkprov-one", "labels": {"sparkprov.deployment": "one"}})
    p = run(serve_absent.ServeAbsent, {"deployments": ["tp"]}, {"containers": cs}, ctx())
    (change,) = p.changes
    assert "sparkprov-tp-head" in change.script and "sparkprov-one" not in change.script


@pytest.mark.parametrize("worker_status,ray_nodes,want", [("running", 2, []), ("exited", 1, ["exited", "Ray sees 1/2"])])
def test_health_counts_members_and_ray_nodes(worker_status, ray_nodes, want):
    head = {"name": "sparkprov-tp-head", "status": "running", "exit_code": 0, "health": 200, "port": 8000,
            "labels": {"sparkprov.deployment": "tp", "sparkprov.role": "ray-head", "sparkprov.nodes": "2"},
            "ray": {"nodes": ray_nodes, "gpus": float(ray_nodes)}, "liveness": {"status": 200, "seconds": 0.1}}
    worker = {"name": "sparkprov-tp-worker", "status": worker_status, "exit_code": 137,
              "labels": {"sparkprov.deployment": "tp", "sparkprov.role": "ray-worker"}}
    exports = {"spark1": {"serving_status": {"containers": [head]}}, "spark2": {"serving_status": {"containers": [worker]}}}
    r = deployment_health.health("tp", head, "spark1", exports)
    assert all(any(w in p for p in r["problems"]) for w in want) and bool(r["problems"]) == bool(want), r
    p = run(deployment_health.DeploymentHealth, {}, {}, ctx(exports=exports))
    assert (p.failed is not None) == bool(want)


@pytest.mark.parametrize("liveness,restarts,want", [
    ({"status": 500, "seconds": 0.2, "error": "EngineDeadError"}, 1,
     "sparkprov-nat-rank0 on spark1 generated no token (HTTP 500); restarted members: sparkprov-nat-rank1 on spark2 (restarts 1)"),
    ({"status": None, "seconds": 15.0, "error": "timed out"}, 0,
     "sparkprov-nat-rank0 on spark1 generated no token (timed out); a rank is lost or the engine is hung"),
    (None, 0, "generated no token (no answer)"),
])
def test_health_is_a_generated_token_not_the_health_page(liveness, restarts, want):
    """Measured on the real vLLM (docs/real-vllm.md): with rank 1 killed, rank 0's /health stayed
    200 for 45 s while requests failed. /health 200 with no token generated is degraded."""
    rank0 = {"name": "sparkprov-nat-rank0", "status": "running", "exit_code": 0, "health": 200, "port": 8000,
             "restarts": 0, "liveness": liveness,
             "labels": {"sparkprov.deployment": "nat", "sparkprov.role": "rank0", "sparkprov.nodes": "2"}}
    rank1 = {"name": "sparkprov-nat-rank1", "status": "running", "exit_code": 0, "restarts": restarts,
             "labels": {"sparkprov.deployment": "nat", "sparkprov.role": "rank"}}
    exports = {"spark1": {"serving_status": {"containers": [rank0]}}, "spark2": {"serving_status": {"containers": [rank1]}}}
    r = deployment_health.health("nat", rank0, "spark1", exports)
    assert r["joined_nodes"] == 2 and [p for p in r["problems"] if want in p], r
    assert run(deployment_health.DeploymentHealth, {}, {}, ctx(exports=exports)).failed


def test_a_rank0_whose_api_is_down_is_named_with_the_members_that_restarted():
    """Measured in the lab on the real vLLM (tests/lab/test_real_vllm.py, 2026-11-26): with rank 1
    killed, rank 0's API server had exited (0) and was restarting by the time status looked: /health
    did not answer. The problem names rank 0 and the member that restarted, not only a port."""
    rank0 = {"name": "sparkprov-nat-rank0", "status": "running", "exit_code": 0, "health": None, "port": 8000,
             "restarts": 1, "labels": {"sparkprov.deployment": "nat", "sparkprov.role": "rank0", "sparkprov.nodes": "2"}}
    rank1 = {"name": "sparkprov-nat-rank1", "status": "running", "exit_code": 0, "restarts": 1,
             "labels": {"sparkprov.deployment": "nat", "sparkprov.role": "rank"}}
    exports = {"spark1": {"serving_status": {"containers": [rank0]}}, "spark2": {"serving_status": {"containers": [rank1]}}}
    assert deployment_health.health("nat", rank0, "spark1", exports)["problems"] == [
        "sparkprov-nat-rank0 on spark1: /health on port 8000: no answer; restarted members: "
        "sparkprov-nat-rank0 on spark1 (restarts 1), sparkprov-nat-rank1 on spark2 (restarts 1)"]
    rank0.update(health=503, restarts=0)
    assert deployment_health.health("nat", rank0, "spark1", exports)["problems"] == [
        "sparkprov-nat-rank0 on spark1: /health on port 8000: HTTP 503; restarted members: sparkprov-nat-rank1 on spark2 (restarts 1)"]


def test_allreduce_needs_the_gpu_unless_gloo_and_fails_below_the_threshold():
    args = {"phase": "run", "hosts": ["spark1", "spark2"], "image": "img:1"}
    exports = {"spark1": {"allreduce_addr": "192.168.100.11"}}
    p = run(allreduce.Allreduce, args, {"fabric": fabric("spark1"), "image": {"id": "sha256:x"}}, ctx(exports=exports))
    (change,) = p.changes
    assert "--gpus all" in change.script and "--backend nccl" in change.script
    assert "cannot see the GPU" in change.outcome("sparkprov: no CUDA device is visible in this container\n@rc=1\n")
    assert "exit status 3" in change.outcome("Traceback ...\nRuntimeError: boom\n@rc=3\n")
    doc = ('{"allreduce": {"backend": "gloo", "largest": {"busbw_gbs": 1.5, "algbw_gbs": 1.5, "bytes": 67108864}, '
           '"peak_busbw_gbs": 1.6, "ranks": [{"ifname": "enp1s0f1np1", "address": "192.168.100.11"}]}}')
    assert "below the threshold" in change.outcome(doc + "\n@rc=0")
    g = run(allreduce.Allreduce, {**args, "backend": "gloo", "threshold": 1.0},
            {"fabric": fabric("spark1"), "image": {"id": "sha256:x"}}, ctx(exports=exports))
    assert "--gpus" not in g.changes[0].script and g.changes[0].outcome(doc + "\n@rc=0") is None


def test_check_mode_plans_the_same_changes_and_applies_nothing_here():
    """(The engine never applies in check mode; the plans say what would happen.)"""
    p = run(vllm_ready.VllmReady, {"deployment": DEP}, ready(status="absent", health=None), ctx(check=True))
    assert p.changes and p.failed is None


def test_every_change_of_a_container_is_verified_so_rank0_exports_its_id():
    """The other ranks name rank 0's container ID, which rank 0 exports from its re-plan after the
    apply: a change that skipped verification would leave the ID out on the first run and
    replace every other rank on the second."""
    exports = {"spark1": {"serve_preflight": {"tp": {"node_ip": "192.168.100.11", "rail_net": "192.168.100.0/24"}}}}
    values = {"containers": containers(), "smi": SMI, "ollama": {"models": [{"name": "m", "size": 1}]},
              "fabric": fabric("spark1")}
    p = container_play({"deployment": DEP, "unload_ollama": True}, values, ctx(exports=exports))
    assert len(p.changes) == 3 and all(c.verify for c in p.changes)


def test_preflight_of_a_deployment_on_its_derived_ray_image_lints_clean():
    """cluster-up runs a Ray cluster on an image it derived with Ray: the G35 "ships no Ray"
    warning is not for it, and no rule mistakes the derived tag for an unknown image."""
    from sparkprov.catalog.derive import ImageChoice, derived_tag, ray_requirement

    p = run(serve_preflight.ServePreflight, {"deployment": DEP}, preflight_values("spark1"), ctx())
    assert p.failed is None, p.failed
    assert not [w for w in p.warnings if "ships no Ray" in w], p.warnings
    dep = Deployment.model_validate(DEP)
    image = node.node_image(dep)
    assert image.runs == derived_tag("nvcr.io/nvidia/vllm:26.04-py3", [ray_requirement()]) and image.ray
    # the same launch on the image as it is: the warning is there
    plain = ImageChoice(image.requested, image.requested, "recipe")
    launch = node.launch(dep, "spark1", {"fabric_ip": "192.168.100.11"}, "/home/nvidia", fabric("spark1"), SMI, plain)
    assert [w for w in node.lint_problems(launch, dep)[1] if "ships no Ray" in w]


def test_image_flags_asks_once_per_build_and_keeps_the_answer_here(tmp_path):
    from sparkprov.modules import image_flags

    help_text = (REPO_FIXTURES / "flags" / "vllm-serve-help-all.txt").read_text()
    values = {"digests": {}, "id0": {"id": "sha256:" + "1" * 64, "error": None}}
    args = {"images": ["img:1"], "cache_dir": str(tmp_path)}
    p = run(image_flags.ImageFlags, args, values, ctx())
    (change,) = p.changes
    assert "--help=all" in change.script and "--network none" in change.script and not change.verify
    assert change.outcome(help_text) is None and list(tmp_path.iterdir())
    again = run(image_flags.ImageFlags, args, values, ctx())
    assert not again.changes and again.exports["image_flags"]["ids"] == {"img:1": "sha256:" + "1" * 64}
    assert change.outcome("docker: Error response from daemon") is not None  # not help output: refused


def test_allreduce_rank1_succeeds_without_a_result_of_its_own():
    args = {"phase": "run", "hosts": ["spark1", "spark2"], "image": "img:1", "backend": "gloo"}
    exports = {"spark1": {"allreduce_addr": "192.168.100.11"}}
    p = run(allreduce.Allreduce, args, {"fabric": fabric("spark2"), "image": {"id": "sha256:x"}}, ctx("spark2", exports))
    assert p.changes[0].outcome("UserWarning: Failed to initialize NumPy\n@rc=0\n") is None
    assert "exit status 1" in p.changes[0].outcome("RuntimeError: connection refused\n@rc=1\n")


def test_preflight_with_stage_plays_before_it():
    """--stage: in check mode missing weights are what the stage plays would bring (no failure);
    in a real run the store is read again after them (stale), and still-missing weights fail."""
    empty = StoreFacts(store=f"{HOME}/vllm")
    args = {"deployment": DEP, "staged_here": True}
    p = run(serve_preflight.ServePreflight, args, preflight_values("spark1", store=empty), ctx(check=True))
    assert p.failed is None and "stage plays before would put them in place" in p.msg
    m = serve_preflight.ServePreflight()
    a = m.Args.model_validate(args)
    assert m.stale(a, ctx()) == [m.needs(a, ctx())["store"]] and m.stale(a, ctx(check=True)) == []
    p = run(serve_preflight.ServePreflight, args, preflight_values("spark1", store=empty), ctx())
    assert "weights not staged" in p.failed


def test_an_old_rank_goes_before_a_new_rank0_starts_and_stays_when_rank0_stays():
    """The 'old ranks' play: rank 0's checks say whether this run starts it again; if so, the old
    group's rank on spark2 is removed before the new rank 0 listens (else it would join it)."""
    base = {"spark1": {"serve_preflight": {"tp": {"node_ip": "192.168.100.11", "rail_net": "192.168.100.0/24"}}},
            "spark2": {"serve_preflight": {"tp": {"node_ip": "192.168.100.12", "rail_net": "192.168.100.0/24"}}}}
    old = {"name": "sparkprov-tp-worker", "id": "w" * 64, "status": "running",
           "labels": {"sparkprov.deployment": "tp", "sparkprov.recipe_hash": "0123456789abcdef"}}
    rank0 = {"containers": containers(), "smi": SMI, "ollama": {"models": []}, "fabric": fabric("spark1")}
    checks = container_play({"deployment": DEP, "checks_only": True}, rank0, ctx("spark1", base))
    assert checks.exports == {"starts": {"tp": True}} and not checks.changes  # nothing runs there: it starts

    values = {"containers": containers(old), "smi": SMI, "ollama": {"models": []}, "fabric": fabric("spark2")}
    starts = {**base, "spark1": {**base["spark1"], **checks.exports}}
    p = run(vllm_container.VllmContainer, {"deployment": DEP, "stale_ranks": True}, values, ctx("spark2", starts))
    (rm,) = p.changes
    assert rm.script == "docker rm -f sparkprov-tp-worker >/dev/null" and "would join the new one" in rm.summary
    assert rm.predicts[0][1]["containers"] == []

    stays = {**base, "spark1": {**base["spark1"], "starts": {"tp": False}}}
    kept = run(vllm_container.VllmContainer, {"deployment": DEP, "stale_ranks": True}, values, ctx("spark2", stays))
    assert not kept.changes and kept.msg == "rank 0 stays: its ranks stay"
