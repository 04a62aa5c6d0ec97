"""`invoke history` shows each on-demand start and stop of a deployment with its reason (issue 35): the
node's guard journals them (node/guard.py on_demand), and the play that reads the history on every
target reads the guard's journal in the same gather (plays/upgrade.py find_history). The journal here
is written by the real guard's HTTP endpoint (the fixture of test_on_demand_guard: its daemon against
a stand-in dockerd), the history read with the engine on this machine (connection: local)."""

from __future__ import annotations

import json

from sparkprov.node import ondemand as od
from sparkprov.serving import history
from tests.unit.test_history import ID1, _record
from tests.unit.test_on_demand_guard import KEY, ask, guard  # noqa: F401 (guard: the fixture)

SPEC = {"name": "a", "model": "lab-tiny", "hosts": ["first"], "tp": 1, "on_demand": True}


def _signed_post(g, name, action, reason):
    path = f"/v1/deployments/{name}/{action}"
    body = json.dumps({"reason": reason}).encode()
    return ask(g, "POST", path, od.signed_headers(KEY, "POST", path, body), body)


def test_on_demand_events_are_the_deployments_starts_and_stops_with_their_reasons():
    lines = [json.dumps({"time": "2026-11-29T00:00:01Z", "epoch": 1.0, "kind": "on-demand-start",
                         "reading": "a: a request for lab-tiny", "threshold": "a signed request",
                         "action": "started sparkprov-a"}),
             json.dumps({"time": "2026-11-29T00:00:02Z", "epoch": 2.0, "kind": "on-demand-start",
                         "reading": "ab: a request for other", "threshold": "a signed request",
                         "action": "started sparkprov-ab"}),                       # another deployment
             json.dumps({"time": "2026-11-29T00:00:03Z", "epoch": 3.0, "kind": "mem-floor",
                         "reading": "a: MemFree 1 GiB", "threshold": "x", "action": "drop caches"}),
             '{"time": "2026-11-29T00:00:0',                                         # a line cut short
             json.dumps({"time": "2026-11-29T00:15:04Z", "epoch": 904.0, "kind": "on-demand-stop",
                         "reading": "a: idle 900s (idle_stop_s 900)", "threshold": "a signed request",
                         "action": "stopped sparkprov-a"})]
    got = history.on_demand_events("\n".join(lines), "a", "spark1")
    assert [(e["action"], e["reason"], e["result"], e["host"]) for e in got] == [
        ("start", "a request for lab-tiny", "started sparkprov-a", "spark1"),
        ("stop", "idle 900s (idle_stop_s 900)", "stopped sparkprov-a", "spark1")]


def test_history_reads_the_guards_journal_of_the_gateways_starts_and_stops(guard, monkeypatch):  # noqa: F811
    from sparkprov.data.inventory import load_inventory
    from sparkprov.plays.upgrade import find_history

    g, _, tmp = guard
    g.step()
    assert _signed_post(g, "a", "start", "a request for lab-tiny")[0] == 200
    assert _signed_post(g, "a", "stop", "least recently used: room for b")[0] == 200
    assert _signed_post(g, "c", "stop", "idle 60s")[0] == 403          # not on demand: refused, not journaled

    home = tmp / "home"
    f = home / history.history_file("a").replace("~/", "", 1)
    f.parent.mkdir(parents=True)
    f.write_text(history.json_line(_record(1, "parked", ID1, SPEC, kind="park")) + "\n")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "getent").write_text(f"#!/bin/sh\n[ \"$1\" = passwd ] && echo \"$(id -un):x:$(id -u):$(id -g)::{home}:/bin/sh\"\n")
    (bin_dir / "getent").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("HOME", str(home))
    (tmp / "inventory.yaml").write_text("hosts:\n  first: {connection: local}\n")
    inv = load_inventory(str(tmp / "inventory.yaml"))

    found = find_history(inv, ["first"], "a", forks=1, accept_new_host_keys=False, journal=str(tmp / "journal"))
    assert [r["kind"] for r in found.records] == ["park"]
    assert [(e["host"], e["action"], e["reason"], e["result"]) for e in found.on_demand] == [
        ("first", "start", "a request for lab-tiny", "started sparkprov-a"),
        ("first", "stop", "least recently used: room for b", "stopped sparkprov-a")]
    assert found.on_demand[0]["epoch"] <= found.on_demand[1]["epoch"]


def test_history_and_journal_facts_read_present_absent_and_name_what_is_unreadable():
    import pytest

    from sparkprov.facts.base import FactError
    from sparkprov.facts.history import HistoryFile, OnDemandJournal

    for fact, what in ((HistoryFile("~/h"), "history file"), (OnDemandJournal("/j"), "guard journal")):
        assert fact.parse("@present\na\nb\n", "", 0) == {"exists": True, "text": "a\nb\n"}
        assert fact.parse("@absent\n", "", 0) == {"exists": False, "text": ""}
        with pytest.raises(FactError, match=f"^{what} unreadable: denied"):
            fact.parse("", "denied", 1)
