"""A deployment's history (issue 26) on literal data: the records cluster-up appends on rank 0, what
"last good" is, the record play's script run for real in a shell, and the spec a rollback starts
again rendering the same containers."""

from __future__ import annotations

import subprocess

import pytest

from sparkprov.facts.base import ShellCtx
from sparkprov.facts.history import DeploymentImages, HistoryFile
from sparkprov.modules import deployment_history as dh
from sparkprov.modules.base import FactView, HostContext
from sparkprov.plays import upgrade
from sparkprov.serving import history, node
from sparkprov.serving.deployment import Deployment
from tests.unit.test_serving_modules import SMI, fabric

DEP = {"name": "nat", "model": "lab-tiny", "hosts": ["spark1", "spark2"], "tp": 2, "executor": "native"}
IMG = "sparkprov/lab-vllm-cpu:0.32.0"
ID1, ID2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
DIGEST1 = "sparkprov/lab-vllm-cpu@sha256:" + "a" * 64


def ctx(host, home, exports=None):
    return HostContext(host, {}, {"user": "nvidia", "home": home}, check=False, exports=exports or {},
                       play_hosts=["spark1", "spark2"], become=False)


def plan(args, values, host):
    m = dh.DeploymentHistory()
    a = m.Args.model_validate(args)
    facts = {f.key: values[name] for name, f in m.needs(a, host).items()}
    return m.plan(a, m.view(a, FactView(facts, {}), host), host)


def sh(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)


def images_output(host: str, image_id: str, digests: str) -> str:
    """What DeploymentImages prints on a node (docker inspect's fields, tab-separated)."""
    rank = 0 if host == "spark1" else 1
    return (f"c\t/sparkprov-nat-rank{rank}\t{'c' * 63}{rank}\t{image_id}\t{IMG}\trunning\trecipe{rank}\n"
            f"d\t{image_id}\t{digests}\n")


def node_exports(home, image_id=ID1, digests=f'["{DIGEST1}"]'):
    out = {}
    for h in DEP["hosts"]:
        facts = DeploymentImages("nat").parse(images_output(h, image_id, digests), "", 0)
        p = plan({"deployment": DEP, "phase": "node"}, {"images": facts}, ctx(h, home))
        assert p.failed is None and not p.changes  # it reads, it changes nothing
        out[h] = p.exports
    return out


def record_values(history_text: str, smoke):
    return {"history": {"exists": bool(history_text), "text": history_text},
            "ready": {"id": "c" * 64, "status": "running", "restarts": 0, "smoke": smoke, "health": 200},
            "store": staged_store_for_lab()}


def staged_store_for_lab():
    from sparkprov.staging.plan import StoreFacts

    dep = Deployment.model_validate(DEP)
    (repo, rev), = node.repos(dep)
    return StoreFacts(store="/home/nvidia/realtest", refs={f"hub/models--{repo.replace('/', '--')}/refs/{rev}": "d" * 40})


GOOD = {"status": 200, "content": "The answer is 204.", "finish": "stop"}
WRONG = {"status": 200, "content": "The answer is 4.", "finish": "stop"}


def test_node_phase_reads_container_image_id_and_registry_digest(tmp_path):
    ex = node_exports(str(tmp_path))
    entry = ex["spark2"]["history_node"]["nat"]
    assert entry == {"host": "spark2", "container": "sparkprov-nat-rank1", "container_id": "c" * 63 + "1",
                     "image": IMG, "image_id": ID1, "digest": DIGEST1, "recipe_hash": "recipe1", "status": "running"}
    # a node that runs nothing of the deployment says so
    p = plan({"deployment": DEP, "phase": "node"}, {"images": {"containers": [], "digests": {}}}, ctx("spark1", "/h"))
    assert p.exports["history_node"]["nat"]["container"] is None


def test_record_appends_once_per_start_and_the_script_writes_the_file(tmp_path):
    home = str(tmp_path)
    exports = node_exports(home)
    args = {"deployment": DEP, "phase": "record", "time": "2026-11-26T13:00:00Z"}
    p = plan(args, record_values("", GOOD), ctx("spark1", home, exports))
    (change,) = p.changes
    assert "record start #1 of nat (start, passed)" == change.summary
    r = sh(change.script)  # the script the record play sends, run in a shell
    assert r.returncode == 0, r.stderr
    path = tmp_path / ".local/state/sparkprov/deployments/nat/history.jsonl"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    # read back with the fact's own command, as the next run's gather does
    read = sh(HistoryFile(history.history_file("nat")).command(ShellCtx(home)))
    text = HistoryFile("x").parse(read.stdout, read.stderr, read.returncode)["text"]
    (rec,) = history.parse(text)
    assert rec["n"] == 1 and rec["result"] == "passed" and rec["problem"] is None
    assert rec["nodes"]["spark1"]["digest"] == DIGEST1 and rec["nodes"]["spark2"]["image_id"] == ID1
    assert rec["model"]["commit"] == "d" * 40 and rec["model"]["repo"]
    assert rec["smoke"]["content"] == "The answer is 204." and rec["spec"]["executor"] == "native"
    # the same start again (a rerun, or the verify step): nothing to record
    again = plan(args, record_values(text, GOOD), ctx("spark1", home, exports))
    assert not again.changes and again.msg == "start #1 recorded (passed)"
    assert again.exports["history"]["nat"]["record"]["n"] == 1


def test_a_wrong_answer_or_a_reported_failure_records_a_failed_start(tmp_path):
    home = str(tmp_path)
    first = history.json_line(_record(1, history.PASSED, ID1))
    exports = node_exports(home, ID2, "[]")  # another build, no registry digest
    wrong = plan({"deployment": {**DEP, "image_override": IMG + "-wrong-answers"}, "phase": "record"},
                 record_values(first + "\n", WRONG), ctx("spark1", home, exports))
    rec = wrong.exports["history"]["nat"]["record"]
    assert rec["n"] == 2 and rec["result"] == "failed" and "204" in rec["problem"], rec
    assert rec["spec"]["image_override"] == IMG + "-wrong-answers" and rec["nodes"]["spark1"]["digest"] is None
    told = plan({"deployment": DEP, "phase": "record", "failure": "spark1: /health timed out"},
                record_values(first + "\n", None), ctx("spark1", home, exports))
    assert told.exports["history"]["nat"]["record"]["problem"] == "spark1: /health timed out"


def _record(n, result, image_id, spec=None, kind="start"):
    nodes = {h: {"host": h, "container_id": f"{n}{h}", "image": IMG, "image_id": image_id, "digest": None,
                 "recipe_hash": "r"} for h in DEP["hosts"]}
    return {"n": n, "time": f"t{n}", "kind": kind, "result": result, "spec": spec or {**DEP, "overrides": {}},
            "nodes": nodes, "model": {}, "problem": None if result == "passed" else "wrong"}


def test_last_good_skips_failed_starts_and_the_spec_that_just_failed():
    new_spec = {**DEP, "image_override": "x:2"}
    records = [_record(1, "passed", ID1), _record(2, "passed", ID2, new_spec), _record(3, "failed", ID2, new_spec)]
    assert history.last_good(records)["n"] == 2
    assert history.last_good(records, unlike=new_spec)["n"] == 1  # 2 ran the spec that failed in 3
    assert history.last_good([_record(1, "failed", ID1)]) is None
    # a failed upgrade goes back to the last good start; a failed start of the last good spec is no upgrade
    upgraded = [_record(1, "passed", ID1), _record(2, "failed", ID2, new_spec)]
    assert history.rollback_target(upgraded, new_spec)["n"] == 1
    assert history.rollback_target(records, new_spec) is None  # 2 passed with the spec that failed in 3
    assert history.rollback_target([_record(1, "passed", ID1), _record(2, "failed", ID1)], {**DEP, "overrides": {}}) is None
    lines = "\n".join(history.json_line(r) for r in records) + "\n{cut sho"  # a write cut short
    assert [r["n"] for r in history.parse(lines)] == [1, 2, 3]
    rows = history.rows(records)
    assert [r["result"] for r in rows if r["n"]] == ["passed", "passed (last good)", "failed"]


def test_a_rollback_to_what_runs_removes_nothing_first():
    """`invoke rollback --to N` where the newest start passed with N's spec: cluster-up's plays
    converge (nothing restarted); any other target, or a newest start that failed, goes down first."""
    other = {**DEP, "image_override": "x:2"}
    one, two = _record(1, "passed", ID1), _record(2, "passed", ID2, other)
    assert history.runs_already([one], one)
    assert history.runs_already([one, two, _record(3, "passed", ID1, kind="rollback")], one)  # #3 ran #1's spec
    assert not history.runs_already([one, two], one)
    assert history.runs_already([one, two], two)
    assert not history.runs_already([one, _record(2, "failed", ID1)], one)  # the same spec failed last
    assert not history.runs_already([], one)


def test_digest_changes_names_a_node_that_runs_another_build():
    was = _record(1, "passed", ID1)
    assert history.digest_changes(was, was["nodes"]) == []
    now = {**was["nodes"], "spark2": {**was["nodes"]["spark2"], "image_id": ID2}}
    (line,) = history.digest_changes(was, now)
    assert line.startswith("spark2 runs") and ID2[7:19] in line and ID1[7:19] in line


def test_a_recorded_spec_starts_the_same_containers_again():
    """deployment_from(spec) renders exactly the containers (recipe hashes) of the start it records."""
    dep = Deployment.model_validate({**DEP, "image_override": IMG + "-wrong-answers"})
    back = upgrade.deployment_from(dh.spec_of(dep))
    again = Deployment.model_validate(back.as_args())
    assert again == dep
    for h in DEP["hosts"]:
        specs = []
        for d in (dep, again):
            launch = node.launch(d, h, {}, "/home/nvidia", fabric(h), SMI)
            specs.append(node.container(d, h, launch, "192.168.100.11", "rank0id" if h == "spark2" else ""))
        assert specs[0].argv == specs[1].argv and specs[0].image == IMG + "-wrong-answers"
    # without the override the recipe's image runs (another hash: cluster-up replaces the containers)
    plain = Deployment.model_validate(DEP)
    assert node.node_image(plain).requested == IMG and node.node_image(dep).requested == IMG + "-wrong-answers"
    assert node.node_image(dep).why == "--image" and node.node_image(plain).why == "recipe"


@pytest.mark.parametrize("image", ["Not An Image", "vllm/vllm-openai:v1\nrm -rf /", "-x", "a b"])
def test_cluster_up_image_is_refused_before_any_host(image):
    from sparkprov.options import OptionError
    from sparkprov.cli.cluster import apply_image_option

    with pytest.raises(OptionError) as e:
        apply_image_option(image, [object()])
    assert e.value.line().startswith("--image") and "\n" not in e.value.line()


def test_cluster_up_image_names_one_deployment():
    from sparkprov.options import OptionError
    from sparkprov.cli.cluster import apply_image_option
    from sparkprov.serving.deployment import Deployment

    deps = [Deployment(name="a", model="lab-tiny", hosts=["spark1"]), Deployment(name="b", model="lab-tiny",
                                                                                 hosts=["spark2"])]
    with pytest.raises(OptionError, match="one deployment"):
        apply_image_option("sparkprov/lab-vllm-cpu:0.32.0-wrong-answers", deps)
    apply_image_option("sparkprov/lab-vllm-cpu:0.32.0-wrong-answers", deps[:1])
    assert deps[0].as_args()["image_override"] == "sparkprov/lab-vllm-cpu:0.32.0-wrong-answers"
    assert "image_override" not in deps[1].as_args()  # a deployment without --image: its args as before


def test_describe_says_what_failed_and_that_it_rolled_back():
    line = upgrade.describe("nat", {"serving": True, "failure": "spark1: smoke test '12*17' -> 'The answer is 4.'",
                                    "to": 1, "seconds": 61.2, "record": 3, "notes": []})
    assert line.startswith("nat: the new start failed (spark1: smoke test") and "rolled back to start #1" in line


def test_history_facts_parse_what_the_node_prints():
    assert HistoryFile("x").parse("@absent\n", "", 0) == {"exists": False, "text": ""}
    got = DeploymentImages("nat").parse(images_output("spark1", ID1, "null") + "garbage\n", "", 0)
    assert got["digests"] == {ID1: []} and got["containers"][0]["name"] == "sparkprov-nat-rank0"


def test_only_an_upgrade_of_what_ran_is_rolled_back_not_a_first_start_of_an_old_name():
    """A first start (no container of the deployment ran on its node) has nothing to go back to, though
    an earlier deployment of the same name (removed since) left starts in the history; a start that
    replaced the running container is an upgrade. Read from what vllm_container's start exports once
    it ran (REPLACED), never from its words."""
    from tests.unit.test_serving_modules import container_play, containers, ctx

    d = Deployment(name="one", model="lab-tiny", hosts=["spark1"], port=8000)
    values = {"smi": SMI, "ollama": {"models": []}}

    def start(running):
        p = container_play({"deployment": d.as_args()}, {**values, "containers": containers(*running)},
                ctx("spark1"))
        (change,) = [c for c in p.changes if c.exports]  # the start: the one change that exports
        return {"spark1": change.exports}

    first = start([])
    assert first == {"spark1": {"replaced": {"one": None}}} and not upgrade.replaced_running(first, d)
    old = {"name": "sparkprov-one", "id": "f" * 64, "status": "running",
           "labels": {"sparkprov.deployment": "one", "sparkprov.recipe_hash": "0484217cd6890aa5"}}
    again = start([old])
    assert again == {"spark1": {"replaced": {"one": "sparkprov-one"}}} and upgrade.replaced_running(again, d)
    other = Deployment(name="two", model="lab-tiny", hosts=["spark1"], port=8001)
    assert not upgrade.replaced_running(again, other)
    # another deployment started on the same host later in the run keeps this one's entry
    later = container_play({"deployment": other.as_args()}, {**values, "containers": containers(old)},
                ctx("spark1", exports=again))
    (change,) = [c for c in later.changes if c.exports]
    assert upgrade.replaced_running({"spark1": change.exports}, d)
