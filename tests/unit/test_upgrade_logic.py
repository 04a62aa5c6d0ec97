"""What cluster-up decides after a start, on literal data (issue 36: these were held only by lab
tests): a failed upgrade goes back to the last good start, a start that keeps less than the bench
gate's ratio is a failed start like any other and goes back too, and --replace brings back what it
removed when the new deployment fails (and only then). plays/upgrade.py start_failure and
after_start, plays/replace.py serving_on, in_the_way and coming_back."""

from __future__ import annotations

import copy

from sparkprov.plays import replace, upgrade
from sparkprov.serving import bench as sb
from sparkprov.serving.deployment import Deployment
from tests.unit.test_bench_gate import HIGH
from tests.unit.test_history import DEP, ID1, ID2, _record

NEW_SPEC = {**DEP, "image_override": "sparkprov/lab-vllm-cpu:0.32.0-slow"}
HOSTS = DEP["hosts"]


def history_of(*records):
    return [_record(n, result, image, spec) for n, (result, image, spec) in enumerate(records, 1)]


# -- a failed upgrade -------------------------------------------------------------------------------

def test_a_failed_upgrade_goes_back_to_the_last_good_start():
    records = history_of(("passed", ID1, DEP), ("failed", ID2, NEW_SPEC))
    step = upgrade.after_start("spark1: smoke test '12*17' -> '4'", True, records, NEW_SPEC, HOSTS)
    assert step.failure == "spark1: smoke test '12*17' -> '4'" and step.rollback_to["n"] == 1


def test_a_failed_first_start_is_removed_whatever_an_old_deployment_of_its_name_left():
    records = history_of(("passed", ID1, DEP), ("failed", ID2, NEW_SPEC))
    step = upgrade.after_start("spark2: /health never answered", False, records, NEW_SPEC, HOSTS)
    assert step.failure and step.rollback_to is None


def test_a_failed_start_of_the_last_good_spec_is_no_upgrade_and_is_removed():
    records = history_of(("passed", ID1, DEP), ("failed", ID1, DEP))
    assert upgrade.after_start("spark2: rank lost", True, records, DEP, HOSTS).rollback_to is None


def test_no_rollback_onto_a_host_out_of_reach():
    records = history_of(("passed", ID1, DEP), ("failed", ID2, NEW_SPEC))
    assert upgrade.after_start("spark2: unreachable", True, records, NEW_SPEC, ["spark1"]).rollback_to is None


def test_a_start_that_passed_stays():
    records = history_of(("passed", ID1, DEP), ("passed", ID2, NEW_SPEC))
    step = upgrade.after_start(upgrade.start_failure(None, None), True, records, NEW_SPEC, HOSTS)
    assert step.failure is None and step.rollback_to is None


# -- the bench gate ---------------------------------------------------------------------------------

def one_request_at_a_time(run):
    """The lab's slow build (--max-num-seqs 1): its concurrency-1 speed at every level."""
    slow = copy.deepcopy(run)
    for r in slow["rows"]:
        r["output_throughput"] = run["rows"][0]["output_throughput"]
    return slow


def test_an_upgrade_below_the_gate_is_a_failed_start_and_goes_back():
    gated = sb.gate(one_request_at_a_time(HIGH), HIGH, 0.6)
    failure = upgrade.start_failure(None, gated)
    assert failure == gated["line"] and failure.endswith("below the gate")
    records = history_of(("passed", ID1, DEP), ("failed", ID2, NEW_SPEC))
    assert upgrade.after_start(failure, True, records, NEW_SPEC, HOSTS).rollback_to["n"] == 1


def test_an_upgrade_that_keeps_up_passes_the_gate_and_a_failed_play_comes_first():
    assert upgrade.start_failure(None, sb.gate(HIGH, HIGH, 0.9)) is None
    below = sb.gate(one_request_at_a_time(HIGH), HIGH, 0.6)
    assert upgrade.start_failure("spark1: the container exited", below) == "spark1: the container exited"


# -- --replace --------------------------------------------------------------------------------------

def container(name, deployment, role, rank=None):
    labels = {"sparkprov.managed": "1", "sparkprov.deployment": deployment, "sparkprov.role": role}
    if rank is not None:
        labels["sparkprov.rank"] = str(rank)
    return {"name": name, "status": "running", "image": "sparkprov/lab-vllm-cpu:0.32.0", "labels": labels}


# what the status play reads with `one` (tp 1) on spark1, `pair` (tp 2) on spark1 and spark2, the
# gateway on spark3 and a rank of `far` on spark3 alone
STATUS = {"spark1": [container("sparkprov-one", "one", "server"),
                     container("sparkprov-pair-rank0", "pair", "rank0", 0)],
          "spark2": [container("sparkprov-pair-rank1", "pair", "rank", 1)],
          "spark3": [container("sparkprov-gateway", "gateway", "gateway"),
                     container("sparkprov-far-rank0", "far", "rank0", 0)]}


def test_what_serves_where_and_its_rank_0():
    runs, heads = replace.serving_on(STATUS)
    assert runs == {"one": {"spark1"}, "pair": {"spark1", "spark2"}, "far": {"spark3"}}
    assert heads == {"one": "spark1", "pair": "spark1", "far": "spark3"}


def test_a_new_deployment_replaces_every_deployment_on_its_hosts_once():
    runs, _ = replace.serving_on(STATUS)
    new = Deployment(name="big", model="lab-tiny", hosts=["spark2"])
    also = Deployment(name="again", model="lab-tiny", hosts=["spark1"])
    assert [(n, d.name) for n, d in replace.in_the_way(runs, [new, also])] == [("pair", "big"), ("one", "again")]
    # a deployment started again in its own place replaces nothing of itself, only the others there
    again = replace.in_the_way(runs, [Deployment(name="one", model="lab-tiny", hosts=["spark1"])])
    assert [n for n, _ in again] == ["pair"]
    assert replace.in_the_way(runs, [Deployment(name="far", model="lab-tiny", hosts=["spark3"])]) == []


def test_what_was_replaced_comes_back_when_the_new_one_fails_and_only_then():
    runs, _ = replace.serving_on(STATUS)
    big = Deployment(name="big", model="lab-tiny", hosts=["spark1", "spark2"], tp=2, executor="native")
    good = _record(4, "passed", ID1, DEP)
    making_room = replace.Replacing([replace.Replaced(n, sorted(runs[n]), good, d.name)
                                     for n, d in replace.in_the_way(runs, [big])])
    assert [r.name for r in making_room.replaced] == ["one", "pair"]
    # the new one failed and nothing of it serves: both come back, each instead of it
    back = replace.coming_back(making_room, [big], {"big"}, {})
    assert [(r.name, d.name) for r, d in back] == [("one", "big"), ("pair", "big")]
    # it serves: nothing comes back
    assert replace.coming_back(making_room, [big], set(), {}) == []
    # it failed, but its own rollback serves again on those hosts: nothing comes back either
    assert replace.coming_back(making_room, [big], {"big"}, {"big": {"serving": True}}) == []
    assert len(replace.coming_back(making_room, [big], {"big"}, {"big": {"serving": False}})) == 2
