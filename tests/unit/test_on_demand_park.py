"""Parked deployments (issue 35, docs/on-demand.md): cluster-up --park and a playbook's on_demand: true
create the container a start would run (the same argv as `docker create`, the same recipe hash),
leave it stopped, record a park, and a rerun changes nothing; on literal facts."""

from __future__ import annotations

import pytest

from sparkprov.errors import InputError
from sparkprov.modules import deployment_history as dh
from sparkprov.modules import deployment_health, serve_preflight
from sparkprov.node import ondemand
from sparkprov.options import OptionError
from sparkprov.plays.cluster import park, up_state
from sparkprov.plays.options import UpOptions
from sparkprov.plays.serve import up_book
from sparkprov.serving import history
from sparkprov.serving.deployment import Deployment
from tests.unit.test_serving_modules import SMI, container_play, containers, ctx, preflight_values, run, staged_store

ONE = {"name": "od", "model": "qwen3.6-27b", "hosts": ["spark1"]}
PARKED = {**ONE, "on_demand": True, "idle_stop_s": 600}


def plan(dep, *running):
    values = {"containers": containers(*running), "smi": SMI, "ollama": {"models": []}}
    return container_play({"deployment": dep}, values, ctx())


def made(p):
    """The container a plan's last change makes (its predicted state) and the change."""
    change = p.changes[-1]
    return change.predicts[0][1]["containers"][-1], change


def test_a_parked_container_is_the_started_ones_argv_as_docker_create_with_the_same_hash():
    started, start = made(plan(ONE))
    parked, create = made(plan(PARKED))
    assert parked["status"] == "created" and started["status"] == "running"
    assert parked["labels"]["sparkprov.recipe_hash"] == started["labels"]["sparkprov.recipe_hash"]
    assert parked["labels"][ondemand.ON_DEMAND_LABEL] == "1" and parked["labels"][ondemand.IDLE_STOP_LABEL] == "600"
    assert ondemand.ON_DEMAND_LABEL not in started["labels"]
    run_line = next(line for line in start.script.splitlines() if "docker run -d" in line)
    create_line = next(line for line in create.script.splitlines() if "docker create" in line)
    # the same words, `run -d` as `create`, the on-demand labels after the container's own
    assert create_line.replace("docker create ", "docker run -d ").replace(
        " --label sparkprov.on_demand=1 --label sparkprov.idle_stop_s=600"
        f" --label {ondemand.UTILIZATION_LABEL}=0.85", "") == run_line  # the recipe's --gpu-memory-utilization
    # no load, so no page-cache drop as root
    assert not any(c.become for c in plan(PARKED).changes)


def test_a_rerun_leaves_a_parked_container_parked_or_started_by_the_gateway():
    parked, _ = made(plan(PARKED))
    for status in ("created", "exited", "running"):
        again = plan(PARKED, {**parked, "id": "c" * 64, "status": status})
        assert not again.changes, status
        assert again.msg.startswith("sparkprov-od " + (f"parked ({status})" if status != "running" else "parked"))


def test_on_demand_or_not_is_a_label_outside_the_hash_so_the_other_kind_is_made_again():
    parked, _ = made(plan(PARKED))
    started, _ = made(plan(ONE))
    fixed = plan(ONE, {**parked, "id": "c" * 64, "status": "running"})
    assert "no longer on demand" in fixed.changes[-1].summary and "docker run -d" in fixed.changes[-1].script
    to_park = plan(PARKED, {**started, "id": "c" * 64, "status": "running"})
    assert ": on demand" in to_park.changes[-1].summary and "docker create" in to_park.changes[-1].script


def test_a_parked_deployment_has_no_ready_play_and_a_started_one_has():
    book = up_book([Deployment.model_validate(PARKED), Deployment.model_validate({**ONE, "name": "on"})],
                   UpOptions())
    names = [p.name for p in book.plays]
    assert "od: containers" in names and "od: ready" not in names and "on: ready" in names


def preflight(dep, **values):
    return run(serve_preflight.ServePreflight, {"deployment": dep},
               preflight_values("spark1", store=staged_store(ONE), **values), ctx())


def test_preflight_of_a_park_admits_no_memory_now_but_holds_the_port_of_every_parked_one():
    full = {"MemTotal": 128 * 2**30, "MemAvailable": 2 * 2**30, "Cached": 0}
    start = preflight(ONE, mem=full)
    assert "needs" in start.failed, start.failed
    p = preflight(PARKED, mem=full)
    assert p.failed is None and "parked: its memory is admitted when the gateway starts it" in p.msg
    other = {"name": "sparkprov-b", "status": "exited", "id": "b" * 64,
             "labels": {"sparkprov.deployment": "b", "sparkprov.port": "8000", ondemand.ON_DEMAND_LABEL: "1"}}
    for dep in (PARKED, ONE):  # a parked one holds its port for when it starts, against parks and starts alike
        clash = preflight(dep, containers=containers(other))
        assert "holds port 8000" in clash.failed, dep


def test_park_marks_a_deployment_on_demand_and_refuses_a_multi_node_one_in_one_line():
    assert park(Deployment.model_validate(ONE)).on_demand is True
    with pytest.raises(OptionError) as e:
        park(Deployment.model_validate({"name": "tp", "model": "llama-3.3-70b", "hosts": ["spark1", "spark2"],
                                        "tp": 2}))
    assert "\n" not in e.value.line() and "single-node only" in e.value.line()


def test_idle_stop_s_without_on_demand_is_refused():
    with pytest.raises(ValueError, match="give on_demand: true"):
        Deployment.model_validate({**ONE, "idle_stop_s": 60})


def test_a_playbook_on_demand_deployment_on_a_recipe_that_restarts_always_is_refused():
    from sparkprov.serving.node import catalog_for

    dep = Deployment.model_validate(PARKED)
    cat = catalog_for(dep)
    recipe = cat.get(dep.model)
    recipe.docker.restart = "always"
    try:
        with pytest.raises(InputError, match="docker would start every parked one"):
            dep.check(cat)
    finally:
        recipe.docker.restart = "unless-stopped"


def test_the_arguments_and_the_history_spec_of_a_deployment_not_on_demand_are_as_before():
    dep = Deployment.model_validate(ONE)
    assert "on_demand" not in dep.as_args() and "idle_stop_s" not in dep.as_args()
    assert "on_demand" not in dh.spec_of(dep)
    assert dh.spec_of(Deployment.model_validate(PARKED))["on_demand"] is True


def test_a_park_is_recorded_as_parked_without_a_smoke_answer_and_is_no_rollback_target():
    def rec(records, kind, failure=None):
        return history.new_record(records, time="t", kind=kind, rollback_of=None, spec={"name": "od"}, nodes={},
                                  model={}, smoke=None, failure=failure, smoke_check=lambda s: [])
    parked = rec([], history.PARK)
    assert parked["result"] == history.PARKED and parked["problem"] is None and parked["smoke"] is None
    assert rec([], history.START)["result"] == history.FAILED  # a start without an answer failed
    assert rec([], history.PARK, "spark1: docker create failed")["result"] == history.FAILED
    assert history.last_good([parked]) is None


@pytest.mark.parametrize("on_demand,changed,check,want", [
    (True, True, False, "parked"), (True, False, False, "on demand, unchanged"), (True, True, True, "would park"),
    (False, True, False, "started"), (False, False, True, "already up, unchanged")])
def test_cluster_up_says_parked(on_demand, changed, check, want):
    assert up_state(on_demand, changed, check) == want


@pytest.mark.parametrize("status,health,want", [
    ("created", None, "parked"), ("exited", None, "parked"), ("running", None, "starting"),
    ("running", 503, "starting"), ("running", 200, "serving"), ("restarting", None, "restarting")])
def test_status_shows_parked_starting_serving(status, health, want):
    assert ondemand.state({"status": status}, health) == want


@pytest.mark.parametrize("status,health,liveness,problem", [
    ("created", None, None, None), ("exited", None, None, None),      # parked: what it should be
    ("running", None, None, None),                                    # starting: the gateway's activation
    ("running", 200, {"status": 200, "seconds": 0.1}, None),          # serving
    ("running", 200, {"status": 500, "seconds": 0.1, "error": "x"}, "generated no token"),
    ("restarting", None, None, "is restarting")])
def test_status_counts_a_parked_or_starting_on_demand_deployment_healthy(status, health, liveness, problem):
    lead = {"name": "sparkprov-od", "status": status, "exit_code": 0, "restarts": 0, "health": health, "port": 8000,
            "liveness": liveness, "labels": {"sparkprov.deployment": "od", "sparkprov.role": "server",
                                             ondemand.ON_DEMAND_LABEL: "1"}}
    exports = {"spark1": {"serving_status": {"containers": [lead]}}}
    p = run(deployment_health.DeploymentHealth, {}, {}, ctx(exports=exports))
    assert (p.failed is None) == (problem is None) and (problem is None or problem in p.failed), p
    if status in ("created", "exited"):
        assert p.msg == "od: parked (on demand)"
    fixed = {**lead, "labels": {k: v for k, v in lead["labels"].items() if k != ondemand.ON_DEMAND_LABEL}}
    if status != "running" or health != 200:   # the same container not on demand is degraded
        assert run(deployment_health.DeploymentHealth, {}, {},
                   ctx(exports={"spark1": {"serving_status": {"containers": [fixed]}}})).failed


def test_replace_never_removes_an_on_demand_deployment():
    from sparkprov.plays import replace

    def c(dep, status, on_demand):
        labels = {"sparkprov.deployment": dep, "sparkprov.role": "server", **({ondemand.ON_DEMAND_LABEL: "1"}
                                                                              if on_demand else {})}
        return {"name": f"sparkprov-{dep}", "status": status, "labels": labels}
    runs, heads = replace.serving_on({"spark1": [c("od", "exited", True), c("up", "running", True),
                                                 c("fixed", "running", False)]})
    assert runs == {"fixed": {"spark1"}} and heads == {"fixed": "spark1"}
