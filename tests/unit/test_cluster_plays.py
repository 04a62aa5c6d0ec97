"""cluster-up's, status's and rollback's decisions in sparkprov/plays on literal data: which hosts a
run touches, what its summary says of each deployment (a start record, a rollback), and which
recorded start `invoke rollback` goes back to."""

from __future__ import annotations

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.errors import InputError
from sparkprov.plays import cluster, upgrade
from sparkprov.serving.deployment import Deployment
from tests.fixtures.golden import make
from tests.unit.test_history import DEP, ID1, ID2, _record

INV = load_inventory(make.INVENTORY)


def test_a_run_touches_the_hosts_of_its_deployments_in_inventory_order_narrowed_by_limit():
    deps = [Deployment(name="b", model="lab-tiny", hosts=["spark4"]),
            Deployment(name="a", model="lab-tiny", hosts=["spark2", "spark1"], tp=2)]
    assert cluster.up_targets(INV, deps, None) == ["spark1", "spark2", "spark4"]
    assert cluster.up_targets(INV, deps, ["spark4", "spark3"]) == ["spark4"]


def _result(**states):
    return cluster.UpResult(check=False, seconds=1.5, remote_calls={"spark1": 2},
                            deployments={n: {"alias": "lab-tiny", "state": s} for n, s in states.items()})


def test_the_summary_carries_each_start_record_and_a_rollback_with_its_line():
    result = _result(nat="failed", one="started")
    failed = {"to": 1, "serving": True, "failure": "spark1: smoke test '12*17' -> '4'", "seconds": 60.0, "record": 4,
              "notes": []}
    settled = upgrade.Settled(recorded={"nat": {"n": 3, "result": "failed"}, "one": {"n": 7, "result": "passed"}},
                              rolled_back={"nat": failed})
    for name in ("nat", "one"):
        cluster.add_settled(result, name, settled)
    summary = result.summary()
    assert list(summary) == ["check", "seconds", "deployments", "remote_calls", "upgrade"]
    assert summary["deployments"]["one"] == {"alias": "lab-tiny", "state": "started",
                                             "history": {"start": 7, "result": "passed"}}
    nat = summary["deployments"]["nat"]
    assert nat["state"] == "failed; rolled back to start #1, serving again" and nat["rollback"] is failed
    assert summary["upgrade"] == [upgrade.describe("nat", failed)]
    # a run without a rollback has no upgrade section (the JSON as before)
    assert list(_result(one="started").summary()) == ["check", "seconds", "deployments", "remote_calls"]


def test_a_rollback_whose_start_fails_again_says_it_was_removed():
    result = _result(nat="failed")
    gone = {"to": 1, "serving": False, "failure": "spark1: load", "rollback_failure": "spark2: load", "seconds": 9.0,
            "record": 5, "notes": []}
    cluster.add_settled(result, "nat", upgrade.Settled(rolled_back={"nat": gone}))
    assert result.deployments["nat"]["state"] == "failed; rollback failed too (removed again)"
    assert "history" not in result.deployments["nat"]


def test_rollback_goes_back_to_a_passed_start_never_to_the_spec_that_failed():
    new_spec = {**DEP, "image_override": "x:2"}
    found = upgrade.DeploymentHistory("nat", "spark1", [_record(1, "passed", ID1), _record(2, "passed", ID2, new_spec),
                                                        _record(3, "failed", ID2, new_spec)])
    assert upgrade.rollback_target(found, None)["n"] == 1  # 2 ran the spec that failed in 3
    assert upgrade.rollback_target(found, 2)["n"] == 2
    with pytest.raises(InputError) as e:
        upgrade.rollback_target(found, 3)
    assert e.value.line() == ("--to 3: start #3 of nat did not pass its smoke test "
                              "(fix: give a start that passed (#1, #2): invoke history nat)")
    with pytest.raises(InputError, match="start #9 of nat is not recorded"):
        upgrade.rollback_target(found, 9)
    only = upgrade.DeploymentHistory("nat", "spark1", [_record(1, "passed", ID1)])
    with pytest.raises(InputError, match="no start that passed with another spec than start #1"):
        upgrade.rollback_target(only, None)
