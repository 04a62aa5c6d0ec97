"""The engine end to end on the control machine itself (connection: local): converge,
idempotence, check mode, handlers, tags, no_log, the JSON document and exit codes."""

import io
import json
import os
import stat
from pathlib import Path

import pytest

from sparkprov.data.inventory import load_inventory
from sparkprov.data.playbook import load_playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import Runner, RunOptions

PLAYBOOK = Path(__file__).resolve().parents[1] / "fixtures" / "playbooks" / "files.yaml"


@pytest.fixture
def setup(tmp_path):
    base = tmp_path / "tree"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"""
hosts:
  first: {{connection: local}}
vars:
  base: {base}
  secret: "s3cr3t-token-value"
""")
    return inv, base


def run(inv, playbook=PLAYBOOK, **opts):
    report = Report(open(os.devnull, "w"), show_diff=True)
    inventory = load_inventory(inv)
    Runner(inventory, load_playbook(playbook), list(inventory.hosts), RunOptions(**opts), report).run()
    return report


def test_converge_then_idempotent(setup):
    inv, base = setup
    first = run(inv)
    assert first.exit_code() == 0
    tally = first.hosts["first"]
    assert (tally.changed, tally.failed, tally.skipped) == (5, 0, 0)  # dir, config, secret, first, handler
    assert (base / "app.conf").read_text() == "port = 8000\n"
    assert stat.S_IMODE((base / "app.conf").stat().st_mode) == 0o640
    assert stat.S_IMODE(base.stat().st_mode) == 0o750
    assert (base / "reloaded").exists()  # handler ran once
    second = run(inv)
    assert second.hosts["first"].changed == 0
    assert second.hosts["first"].ok == 4
    assert second.hosts["first"].remote_calls == 1  # a no-op run: one remote execution


def test_handler_counts_as_a_task_and_runs_only_when_notified(setup):
    inv, base = setup
    first = run(inv)
    handler = [r for r in first.results if r.task == "reload"]
    assert [r.status for r in handler] == ["changed"]
    (base / "reloaded").unlink()
    second = run(inv)  # nothing changed, so the handler is not notified, even though its file is gone
    assert not [r for r in second.results if r.task == "reload"]
    assert not (base / "reloaded").exists()


def test_check_mode_changes_nothing_and_lists_changes(setup):
    inv, base = setup
    report = run(inv, check=True)
    assert not base.exists()
    changed = [r for r in report.results if r.status == "changed"]
    assert [r.task for r in changed] == ["base dir", "config", "secret", "only on the first host", "reload"] or \
        [r.task for r in changed][:4] == ["base dir", "config", "secret", "only on the first host"]
    assert all(r.msg.startswith("would: ") or r.msg.startswith("output hidden") for r in changed)
    assert report.hosts["first"].remote_calls == 1


def test_drift_is_repaired_and_reported(setup):
    inv, base = setup
    run(inv)
    os.chmod(base / "app.conf", 0o666)
    (base / "token").write_text("tampered")
    report = run(inv)
    by_task = {r.task: r for r in report.results}
    assert by_task["config"].status == "changed" and "mode 0666 -> 0640" in by_task["config"].msg
    assert by_task["secret"].status == "changed"
    assert (base / "token").read_text() == "s3cr3t-token-value"
    assert stat.S_IMODE((base / "app.conf").stat().st_mode) == 0o640


def test_no_log_hides_secret_from_report_and_json(setup):
    inv, base = setup
    report = run(inv)
    doc = report.json()
    assert "s3cr3t-token-value" not in doc
    secret = [r for r in report.results if r.task == "secret"][0]
    assert secret.diff == [] and "no_log" in secret.msg


def test_tags_and_skip_tags(setup):
    inv, base = setup
    skip_secret = run(inv, skip_tags={"secret"})
    assert "secret" not in {r.task for r in skip_secret.results}
    assert not (base / "token").exists() and (base / "app.conf").exists()
    os.chmod(base / "app.conf", 0o600)
    only_config = run(inv, tags={"config"})
    assert [(r.task, r.status) for r in only_config.results] == [("config", "changed"), ("reload", "ok")]
    assert not (base / "token").exists()


def test_json_document_shape(setup):
    inv, _ = setup
    doc = json.loads(run(inv).json())
    assert set(doc) == {"ok", "hosts", "results"} and doc["ok"] is True
    assert set(doc["hosts"]["first"]) == {"ok", "changed", "failed", "skipped", "unreachable", "remote_calls"}
    for r in doc["results"]:
        assert {"host", "play", "task", "module", "status", "msg", "diff"} <= set(r)
        assert r["status"] in {"ok", "changed", "failed", "skipped", "unreachable"}


def test_failed_task_stops_host_and_exit_code_2(setup, tmp_path):
    inv, base = setup
    book = tmp_path / "fail.yaml"
    book.write_text(f"""
- hosts: all
  tasks:
    - name: a file where a directory must be
      file: {{path: {tmp_path}/blocker, content: x}}
    - name: directory over the file
      directory: {{path: {tmp_path}/blocker}}
    - name: never reached
      file: {{path: {tmp_path}/after, content: y}}
""")
    report = run(inv, playbook=book)
    statuses = {r.task: r.status for r in report.results}
    assert statuses["directory over the file"] == "failed"
    assert "never reached" not in statuses
    assert not (tmp_path / "after").exists()
    assert report.exit_code() == 2


def test_unreachable_exit_code_4(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  gone: {address: 127.0.0.1, port: 9, connect_timeout: 2}\nvars: {base: /nonexistent, secret: x}\n")
    report = run(inv)
    assert report.hosts["gone"].unreachable
    assert report.exit_code() == 4


def test_a_cold_play_costs_three_calls_whatever_it_changes(setup):
    """Issue 14: one gather, one apply of every change (handler included), one re-read."""
    inv, base = setup
    first = run(inv)
    assert first.hosts["first"].changed == 5
    assert first.hosts["first"].remote_calls == 3
    assert (base / "reloaded").exists() and (base / "first").read_text() == "1\n"
    assert [r.task for r in first.results] == ["base dir", "config", "secret", "only on the first host", "reload"]


def test_a_failing_change_stops_the_batch_where_it_failed(setup, tmp_path):
    """The combined apply stops at the first failing change: what came before is applied and
    verified, the failing task is named with its own error, nothing after it runs."""
    inv, _ = setup
    book = tmp_path / "mid.yaml"
    book.write_text(f"""
- hosts: all
  tasks:
    - name: before
      file: {{path: {tmp_path}/before, content: x}}
    - name: breaks
      command: {{argv: [sh, -c, "echo the reason >&2; exit 3"], creates: {tmp_path}/never}}
    - name: after
      file: {{path: {tmp_path}/after, content: y}}
""")
    report = run(inv, playbook=book)
    got = [(r.task, r.status) for r in report.results]
    assert got == [("before", "changed"), ("breaks", "failed")], got
    msg = next(r.msg for r in report.results if r.task == "breaks")
    assert "rc=3" in msg and "the reason" in msg, msg
    assert (tmp_path / "before").read_text() == "x" and not (tmp_path / "after").exists()
    assert report.hosts["first"].remote_calls == 3  # gather, the apply that stopped, the re-read verifying "before"


def test_a_task_needing_an_unpredicted_result_splits_the_apply(setup, tmp_path):
    """A command's effect is not predicted; a later task reading the same path plans against the
    real result: the engine applies first, and says so with verbose."""
    inv, _ = setup
    target = tmp_path / "made-by-command"
    book = tmp_path / "split.yaml"
    book.write_text(f"""
- hosts: all
  tasks:
    - name: make it
      command: {{argv: [sh, -c, "printf 'port = 1\\\\n' > {target}"], creates: {target}}}
    - name: then own it
      file: {{path: {target}, content: "port = 1\\n", mode: "0600"}}
""")
    buf = io.StringIO()
    report = Report(buf)
    inventory = load_inventory(inv)
    Runner(inventory, load_playbook(book), list(inventory.hosts), RunOptions(verbose=True), report).run()
    statuses = {r.task: (r.status, r.msg) for r in report.results}
    assert statuses["make it"][0] == "changed"
    # planned against the real file: only the mode changes, not the content
    assert statuses["then own it"][0] == "changed" and "content" not in statuses["then own it"][1], statuses
    assert "applying them first" in buf.getvalue(), buf.getvalue()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_batched_results_keep_task_order_and_ignore_errors_goes_on(setup, tmp_path):
    inv, _ = setup
    (tmp_path / "there").write_text("x")
    book = tmp_path / "order.yaml"
    book.write_text(f"""
- hosts: all
  tasks:
    - name: one
      file: {{path: {tmp_path}/one, content: "1"}}
    - name: already there
      file: {{path: {tmp_path}/there, content: x}}
    - name: may fail
      command: {{argv: [sh, -c, "exit 4"], creates: {tmp_path}/never}}
      ignore_errors: true
    - name: two
      file: {{path: {tmp_path}/two, content: "2"}}
""")
    report = run(inv, playbook=book)
    got = [(r.task, r.status) for r in report.results]
    assert got == [("one", "changed"), ("already there", "ok"), ("may fail", "failed"), ("two", "changed")], got
    assert (tmp_path / "two").read_text() == "2"
    assert report.exit_code() == 2


def test_gather_ahead_reads_every_play_in_one_call(setup, tmp_path):
    """The commands built in code gather the facts of all their plays at first contact: with
    nothing to do, two plays cost one remote call."""
    inv, _ = setup
    for name in ("a", "b"):
        (tmp_path / name).write_text(name)
    book = tmp_path / "two.yaml"
    book.write_text("".join(f"""
- name: play {name}
  hosts: all
  tasks:
    - name: {name}
      file: {{path: {tmp_path}/{name}, content: {name}}}
""" for name in ("a", "b")))
    assert run(inv, playbook=book).hosts["first"].remote_calls == 2  # a gather per play
    assert run(inv, playbook=book, gather_ahead=True).hosts["first"].remote_calls == 1


def test_any_errors_fatal_stops_every_host_of_the_play(tmp_path):
    """A cluster is all its nodes or nothing: with any_errors_fatal a host failing in a play stops
    the others before the next play (which would start half a cluster)."""
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  a: {connection: local}\n  b: {connection: local}\n")
    book = tmp_path / "fatal.yaml"
    book.write_text(f"""
- name: check
  hosts: all
  any_errors_fatal: true
  tasks:
    - name: only b fails
      command: {{argv: [sh, -c, "exit 1"], creates: {tmp_path}/never}}
      when: "inventory_hostname == 'b'"
- name: start
  hosts: all
  tasks:
    - name: would start
      file: {{path: "{tmp_path}/started-{{{{ inventory_hostname }}}}", content: x}}
""")
    report = run(inv, playbook=book)
    assert not list(tmp_path.glob("started-*"))
    stopped = [r for r in report.results if r.task == "stopped"]
    assert [(r.host, r.status) for r in stopped] == [("a", "skipped")] and "any_errors_fatal" in stopped[0].msg


def test_any_errors_fatal_stops_the_whole_group_when_a_play_runs_on_part_of_it(tmp_path):
    """A cluster's plays run on part of it (rank 0, then the other ranks): a rank that fails stops
    rank 0 too, so the next play on rank 0 (its readiness wait, until its timeout) does not run.
    Before, only the failed play's hosts stopped and rank 0 waited its whole timeout (CI, stop 30:
    the wrong-worker-address test took 309 s)."""
    from sparkprov.engine.playbook import Playbook
    from sparkprov.plays.book import play, task

    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  a: {connection: local}\n  b: {connection: local}\n")
    where = ("test", None, None)
    plays = [play("rank 0", ["a"], [task("start", "file", {"path": f"{tmp_path}/rank0", "content": "x"}, where)]),
             play("ranks", ["b"], [task("start", "command", {"argv": ["sh", "-c", "exit 1"],
                                                              "creates": f"{tmp_path}/never"}, where)]),
             play("ready", ["a"], [task("wait", "file", {"path": f"{tmp_path}/ready", "content": "x"}, where)])]
    for p in plays:
        p.any_errors_fatal, p.stops_together = True, ("a", "b")
    report = Report(open(os.devnull, "w"))
    inventory = load_inventory(inv)
    Runner(inventory, Playbook("group", plays), ["a", "b"], RunOptions(), report).run()
    assert (tmp_path / "rank0").exists() and not (tmp_path / "ready").exists()
    stopped = [(r.host, r.play, r.msg) for r in report.results if r.task == "stopped"]
    assert stopped == [("a", "ranks", "another node of its group failed, so every node of it stops here "
                                      "(any_errors_fatal)")], stopped
    assert report.exit_code() == 2


def test_a_reader_that_leaves_early_neither_breaks_nor_stops_the_run(setup):
    """`invoke play ... | head -n 1`: the pipe closes after the first line. The run still applies
    every change (a play stopped halfway is worse than output nobody reads) and ends with its
    own exit status, without a BrokenPipeError traceback."""
    import subprocess
    import sys

    inv, base = setup
    repo = Path(__file__).resolve().parents[2]
    invoke = str(Path(sys.executable).parent / "invoke")
    proc = subprocess.Popen([invoke, "play", str(PLAYBOOK), "--inventory", str(inv)], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    rc = proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    assert first.strip() == b"" or b"PLAY" in first
    assert rc == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert (base / "reloaded").exists() and (base / "app.conf").read_text() == "port = 8000\n"


def test_a_play_built_for_a_deployment_marks_its_results_with_it(setup):
    """plays/ finds a deployment's results by the subject its plays carry (Play.subject), never by the
    play's name: a failure, and the host stopped after it, count for the deployment whose play it was."""
    from sparkprov.engine.playbook import Playbook
    from sparkprov.plays.book import play, task
    from sparkprov.plays.serve import UpOptions, failed_deployments, up_book
    from sparkprov.serving.deployment import Deployment

    inv, _ = setup
    where = ("test", None, None)
    ok = play("cluster-down", ["first"], [task("true", "command", {"argv": ["true"]}, where)])  # a name of a deployment
    bad = play("anything", ["first"], [task("false", "command", {"argv": ["false"]}, where)])
    bad.subject = "b"
    inventory = load_inventory(inv)
    report = Report(open(os.devnull, "w"))
    Runner(inventory, Playbook("t", [ok, bad]), ["first"], RunOptions(), report).run()
    assert [(r.subject, r.status) for r in report.results] == [("", "changed"), ("b", "failed")]
    deps = [Deployment(name=n, model="lab-tiny", hosts=["first"]) for n in ("cluster-down", "b")]
    assert [d.name for d in failed_deployments(report, deps)] == ["b"]
    # every play cluster-up builds for a deployment carries its name
    book = up_book([Deployment(name="x", model="lab-tiny", hosts=["s1", "s2"], tp=2, executor="native")], UpOptions())
    assert {p.subject for p in book.plays} == {"x"}


def test_gather_ahead_leaves_a_fact_that_needs_root_to_its_become_play(setup, tmp_path):
    """A fact that needs root (a 0600 root file's digest) is read as root only in a gather with
    become: read ahead in a play without become it failed, and that error stood for the become play
    after it (found on the lab: `gateway up`'s second run could not read the on-demand key it had
    placed on the node). A gather without become leaves it to its play; one with become, or a later
    play without become, reads it ahead as before."""
    from sparkprov.facts.files import PathState

    inv, _ = setup
    book = tmp_path / "three.yaml"
    book.write_text("".join(f"""
- name: play {name}
  hosts: all
  become: {become}
  tasks:
    - name: {name}
      file: {{path: {tmp_path}/{name}, content: {name}}}
""" for name, become in (("a", "false"), ("b", "true"), ("c", "false"))))
    inventory = load_inventory(inv)
    runner = Runner(inventory, load_playbook(book), ["first"], RunOptions(gather_ahead=True),
                    Report(open(os.devnull, "w")))
    first, hr = runner.playbook.plays[0], runner.runs["first"]
    def files(root):
        return {f.path for f in runner._later_facts(first, hr, root=root) if isinstance(f, PathState)}
    assert f"{tmp_path}/b" not in files(False) and f"{tmp_path}/c" in files(False)
    assert {f"{tmp_path}/b", f"{tmp_path}/c"} <= files(True)
