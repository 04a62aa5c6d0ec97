"""Hostile input: inventories and playbooks full of quotes, `;`, `$()`, backticks, newlines, NULs,
terminal escapes and unicode.

Two promises, proved on real files, a real shell and the real command line (nothing mocked):
- a bad file gets ONE line naming file:line[:col] (exit 1, nothing touched), never a traceback;
- a value that is accepted reaches the shell as the literal value: a file named
  `a'; touch pwned; '` is created under exactly that name, `$(id)` stays `$(id)` in content and
  argv, and nothing named `pwned` ever appears.

The fixed corpus of the nastiest cases is tests/fixtures/hostile/ (first line: `# expect: ...`
for load errors, `# expect-failed: ...` for a task that must fail at run time). Property-based
tests (hypothesis) generate more; their example counts are kept small (CI runs on 2 cores).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from invoke.exceptions import Exit

from sparkprov.cli.common import run_playbook
from sparkprov.data.inventory import load_inventory
from sparkprov.data.playbook import load_playbook
from sparkprov.engine.expr import ExprError, evaluate
from sparkprov.facts.base import ShellCtx
from sparkprov.modules.base import FactView, HostContext
from sparkprov.engine.report import Report
from sparkprov.engine.run import Runner, RunOptions
from sparkprov.errors import InputError
from sparkprov.facts import fabric as fabric_facts
from sparkprov.facts.files import PathState
from sparkprov.modules import fabric
from sparkprov.transport.shell import cmd, heredoc_bytes
from helpers import SAFE_INVENTORY

REPO = Path(__file__).resolve().parents[2]
HOSTILE = REPO / "tests" / "fixtures" / "hostile"

GOOD_PLAYBOOK = """
- hosts: all
  tasks:
    - name: t
      command: {argv: ["true"]}
"""

# The pieces hostile values are made of: shell syntax, quoting, our own framing markers,
# templates, terminal escapes, line breaks of every kind, unicode that reorders or hides text.
NASTY = ["'", '"', ";", "$(touch pwned)", "`touch pwned`", "$HOME", "${IFS}", "\\", " ", "|", "&&", ">", "<",
         "*", "?", "[", "]", "{", "}", "~", "#", "!", "-", "--", "%s", "%n", "\t", "\x1b[31m", "\x07", "é",
         "日本", "\u202e", "\u200b", "\ufeff", "'\"'\"'", "@@SP:", "SPARKPROV_", "EOF", "{{ x }}", "\\0",
         "a'; touch pwned; '", "$'\\x41'"]
LINE_BREAKS = ["\n", "\r", "\r\n", "\x85", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c"]

fragment = st.one_of(st.sampled_from(NASTY), st.text(max_size=4))
hostile = st.lists(fragment, min_size=1, max_size=6).map("".join)
hostile_any = st.lists(st.one_of(fragment, st.sampled_from(LINE_BREAKS + ["\x00"])), min_size=1,
                       max_size=6).map("".join)

POSITIONED = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(:(?P<col>\d+))?: \S")


def assert_one_line(msg: str, file: Path) -> None:
    """One printable line that starts with FILE:LINE[:COL]: (no raw line break of any kind)."""
    assert msg.isprintable(), repr(msg)
    assert len(msg.splitlines()) == 1, repr(msg)
    assert msg.startswith(f"{file}:"), repr(msg)
    m = POSITIONED.match(msg)
    assert m and m.group("file") == str(file), repr(msg)


def dump(data) -> str:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False, width=10_000)


def load_or_input_error(loader, path: Path):
    try:
        return loader(path)
    except InputError as exc:
        assert_one_line(exc.line(), path)
        return None


def expectation(path: Path, tag: str) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith(f"# {tag}: "), first
    return first[len(f"# {tag}: "):]


# -- the fixed corpus, in process --------------------------------------------------------------------

INVENTORIES = sorted((HOSTILE / "inventory").glob("*.yaml"))
PLAYBOOKS = sorted((HOSTILE / "playbook").glob("*.yaml"))
RUNTIME = sorted((HOSTILE / "runtime").glob("*.yaml"))


@pytest.fixture(scope="module")
def safe(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    (d / "inventory.yaml").write_text(SAFE_INVENTORY)
    (d / "good.yaml").write_text(GOOD_PLAYBOOK)
    (d / "local.yaml").write_text("hosts:\n  h1: {connection: local}\n")
    return d


@pytest.mark.parametrize("path", INVENTORIES, ids=lambda p: p.stem)
def test_corpus_inventory_one_line_exit_1_through_the_cli(path, safe):
    with pytest.raises(Exit) as err, contextlib.redirect_stdout(io.StringIO()) as out:
        run_playbook(playbook=str(safe / "good.yaml"), inventory=str(path), hosts=None)
    assert err.value.code == 1
    assert err.value.message == f"sparkprov: {path}{expectation(path, 'expect')}"
    assert_one_line(err.value.message.removeprefix("sparkprov: "), path)
    assert "PLAY [" not in out.getvalue()  # nothing was started


@pytest.mark.parametrize("path", PLAYBOOKS, ids=lambda p: p.stem)
def test_corpus_playbook_one_line_exit_1_through_the_cli(path, safe):
    inv = safe / "inventory.yaml"
    with pytest.raises(Exit) as err, contextlib.redirect_stdout(io.StringIO()) as out:
        run_playbook(playbook=str(path), inventory=str(inv), hosts=None)
    assert err.value.code == 1
    assert err.value.message == f"sparkprov: {path}" + expectation(path, "expect").replace("{inventory}", str(inv))
    assert_one_line(err.value.message.removeprefix("sparkprov: "), path)
    assert "PLAY [" not in out.getvalue()


# -- the fixed corpus as a user runs it: `invoke play`, a separate process ----------------------------

def _invoke(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def corpus_runs(safe):
    """Every corpus file through `invoke play` (two at a time), from an empty directory where an
    injected `touch pwned` would leave its mark."""
    cwd = safe / "cwd"
    cwd.mkdir()
    jobs = {p: ["play", str(safe / "good.yaml"), "--inventory", str(p)] for p in INVENTORIES}
    jobs.update({p: ["play", str(p), "--inventory", str(safe / "inventory.yaml")] for p in PLAYBOOKS})
    jobs.update({p: ["play", str(p), "--inventory", str(safe / "local.yaml")] for p in RUNTIME})
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(jobs, pool.map(lambda a: _invoke(a, cwd), jobs.values())))
    return done, cwd


@pytest.mark.parametrize("path", INVENTORIES + PLAYBOOKS, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_corpus_invoke_play_prints_one_line_and_no_traceback(path, corpus_runs, safe):
    runs, cwd = corpus_runs
    proc = runs[path]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    want = f"sparkprov: {path}" + expectation(path, "expect").replace("{inventory}", str(safe / "inventory.yaml"))
    assert proc.stderr.splitlines() == [want]
    assert proc.stdout == ""
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: p.stem)
def test_corpus_runtime_failure_is_one_task_line_not_a_traceback(path, corpus_runs):
    runs, cwd = corpus_runs
    proc = runs[path]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"h1       | failed   | t: {expectation(path, 'expect-failed')}" in proc.stdout.splitlines()
    assert list(cwd.iterdir()) == []  # the task's `touch pwned` never ran


# -- generated inventories ----------------------------------------------------------------------------

def inventories():
    conn = st.fixed_dictionaries({}, optional={
        "user": st.one_of(hostile_any, st.sampled_from(["nvidia", "root", "a" * 40, "x$", "_u"])),
        "port": st.one_of(st.integers(-5, 70000), hostile_any),
        "ssh_key": hostile_any, "known_hosts": hostile_any, "become_password_file": hostile_any,
        "become_password_env": hostile_any, "connection": st.sampled_from(["ssh", "local", "telnet", "", "ssh\n"]),
        "connect_timeout": st.one_of(st.floats(allow_nan=True), hostile_any),
    })
    name = st.one_of(hostile_any, st.sampled_from(["spark1", "spark-2", "all", "localhost", "a" * 70]))
    entry = st.one_of(st.none(), conn.flatmap(lambda c: st.fixed_dictionaries(
        {}, optional={"address": st.one_of(hostile_any, st.just("127.0.0.1")),
                      "vars": st.dictionaries(hostile_any, hostile_any, max_size=2)}).map(lambda e: {**c, **e})))
    return st.fixed_dictionaries({"hosts": st.dictionaries(name, entry, min_size=1, max_size=3)}, optional={
        "defaults": conn, "vars": st.dictionaries(hostile_any, st.one_of(hostile_any, st.integers()), max_size=3),
        "groups": st.dictionaries(name, st.lists(name, max_size=3), max_size=2),
    })


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=inventories())
def test_generated_inventory_loads_or_is_one_positioned_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("inv") / "inventory.yaml"
    path.write_text(dump(data), encoding="utf-8")
    inv = load_or_input_error(load_inventory, path)
    if inv is not None:  # what is accepted is safe to put on a connection
        for h in inv.hosts.values():
            assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", h.name)
            assert re.fullmatch(r"[A-Za-z0-9.:_\[\]-]+", h.address)
            assert h.user is None or re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}\$?", h.user)
            for p in (h.ssh_key, h.known_hosts, h.become_password_file):
                assert p is None or ("\0" not in p and "\n" not in p)


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(at=st.integers(0, 10_000), junk=st.lists(st.sampled_from(NASTY + LINE_BREAKS + [
    "\x00", "&a", "*a", "!!python/name:os.system", ": ", "- ", "{", "[", "\t", "---\n", "%YAML 1.1\n", "? "]),
    min_size=1, max_size=4).map("".join))
def test_mangled_inventory_text_loads_or_is_one_positioned_line(tmp_path_factory, at, junk):
    """Hostile bytes dropped anywhere into a real inventory (the shipped one)."""
    text = (REPO / "inventory.yaml").read_text()
    at %= len(text) + 1
    path = tmp_path_factory.mktemp("inv") / "inventory.yaml"
    path.write_text(text[:at] + junk + text[at:], encoding="utf-8")
    load_or_input_error(load_inventory, path)


# -- generated playbooks ----------------------------------------------------------------------------

def tasks():
    path = st.one_of(hostile_any, hostile.map(lambda s: "/tmp/sp-hostile/" + s), hostile.map(lambda s: "~/" + s))
    mod = st.one_of(
        st.fixed_dictionaries({"file": st.fixed_dictionaries({"path": path}, optional={
            "content": hostile_any, "mode": st.one_of(hostile_any, st.sampled_from(["0644", "644", 420, "0o644"])),
            "owner": hostile_any, "group": hostile_any, "state": hostile_any})}),
        st.fixed_dictionaries({"directory": st.fixed_dictionaries({"path": path}, optional={"owner": hostile_any})}),
        st.fixed_dictionaries({"command": st.fixed_dictionaries({"argv": st.lists(hostile_any, max_size=4)}, optional={
            "chdir": hostile_any, "creates": hostile_any, "removes": path})}),
        st.fixed_dictionaries({"group": st.fixed_dictionaries({"name": hostile_any})}),
        st.fixed_dictionaries({"user_groups": st.fixed_dictionaries({"groups": st.lists(hostile_any, max_size=2)},
                                                                   optional={"user": hostile_any})}),
        st.fixed_dictionaries({"model_store": st.fixed_dictionaries({}, optional={"path": path,
                                                                                  "compile_cache": hostile_any})}),
        st.fixed_dictionaries({"docker_access": st.fixed_dictionaries({}, optional={
            "smoke_image": hostile_any, "smoke_command": st.lists(hostile_any, max_size=2), "group": hostile_any})}),
        st.fixed_dictionaries({"fabric": st.fixed_dictionaries({}, optional={
            "rails": st.lists(hostile_any, max_size=2), "subnets": st.lists(hostile_any, max_size=2),
            "netplan_file": hostile.map(lambda s: "/etc/netplan/" + s + ".yaml")})}),
        st.dictionaries(hostile_any, st.dictionaries(hostile_any, hostile_any, max_size=2), min_size=1, max_size=1),
    )
    kw = st.fixed_dictionaries({}, optional={
        "name": hostile_any, "when": st.one_of(hostile_any, st.sampled_from(
            ["x == '$(id)'", "not not x", "x in [1, '2']", "a.b[0] == 'c'"])),
        "tags": st.one_of(hostile_any, st.lists(hostile_any, max_size=2)), "notify": st.lists(hostile_any, max_size=1),
        "become": st.one_of(st.booleans(), hostile_any)})
    return st.tuples(mod, kw).map(lambda t: {**t[1], **t[0]})


def playbooks():
    play = st.fixed_dictionaries({"hosts": st.one_of(st.just("all"), hostile_any, st.lists(hostile_any, max_size=2)),
                                  "tasks": st.lists(tasks(), max_size=3)}, optional={
        "name": hostile_any, "become": st.booleans(),
        "vars": st.dictionaries(st.one_of(st.sampled_from(["x", "p"]), hostile_any), hostile_any, max_size=2),
        "handlers": st.lists(tasks(), max_size=1)})
    return st.lists(play, min_size=1, max_size=2)


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(book=playbooks())
def test_generated_playbook_loads_or_is_one_positioned_line(tmp_path_factory, book):
    path = tmp_path_factory.mktemp("book") / "play.yaml"
    path.write_text(dump(book), encoding="utf-8")
    load_or_input_error(load_playbook, path)


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(book=playbooks())
def test_generated_playbook_through_the_cli_is_exit_1_one_line_or_a_run(tmp_path_factory, book):
    """The real command-line path: bad input is `Exit(1)` with one line; good input runs (and
    finds the safe inventory's hosts unreachable: exit 4), nothing in between."""
    d = tmp_path_factory.mktemp("cli")
    (d / "inventory.yaml").write_text(SAFE_INVENTORY)
    path = d / "play.yaml"
    path.write_text(dump(book), encoding="utf-8")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = run_playbook(playbook=str(path), inventory=str(d / "inventory.yaml"), hosts=None)
    except Exit as exc:
        assert exc.code == 1
        assert exc.message.startswith("sparkprov: ")
        assert_one_line(exc.message.removeprefix("sparkprov: "), path)
        return
    assert code in (0, 4), out.getvalue()


# -- quoting: accepted hostile values reach a real shell as literal values ----------------------------

file_name = hostile.filter(lambda s: not set(s) & {"/", "\0", "\n"} and s not in ("", ".", "..")
                           and len(s.encode()) <= 200)
not_a_user = hostile_any.filter(lambda s: "\0" not in s and s.strip() != "" and not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", s))
PLAYBOOK_LITERAL = """
- hosts: all
  vars:
    fname: {fname}
    dname: {dname}
    content: {content}
    marker: {marker}
    victim: {victim}
{argv_vars}
  tasks:
    - name: hostile directory
      directory: {{path: "{{{{ base }}}}/{{{{ dname }}}}", mode: "0750"}}
    - name: hostile file
      file: {{path: "{{{{ base }}}}/{{{{ dname }}}}/{{{{ fname }}}}", content: "{{{{ content }}}}", mode: "0600"}}
      when: {when_true}
    - name: never
      file: {{path: "{{{{ base }}}}/never", content: ""}}
      when: {when_false}
    - name: argv literal
      command:
        argv: ["sh", "-c", 'printf "%s\\\\0" "$@" > "$0"', "{{{{ base }}}}/argv.out", {argv_refs}]
        chdir: "{{{{ base }}}}/{{{{ dname }}}}"
        creates: "{{{{ base }}}}/argv.out"
    - name: hostile user name reaches getent quoted
      user_groups: {{user: "{{{{ victim }}}}", groups: [root]}}
      ignore_errors: true
"""


def _y(value: str) -> str:
    """Any string as one double-quoted YAML scalar (line breaks and controls escaped)."""
    return yaml.safe_dump(value, allow_unicode=True, default_style='"', width=10**9).strip()


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(fname=file_name, dname=file_name, content=hostile_any, argv=st.lists(hostile_any, min_size=1, max_size=4)
       .filter(lambda a: all("\0" not in x for x in a)), victim=not_a_user)
@example(fname="a'; touch pwned; '", dname="$(touch pwned)", content="$(id) `id` '\"\n",
         argv=["$(touch pwned)", "; touch pwned", "'", "\n"], victim="nvidia; touch pwned")
def test_hostile_values_reach_the_shell_literally(tmp_path_factory, fname, dname, content, argv, victim):
    assume(fname != dname)
    d = tmp_path_factory.mktemp("lit")
    base, cwd = d / "base", d / "cwd"
    cwd.mkdir()
    marker = content
    inv = d / "inventory.yaml"
    inv.write_text(f"hosts:\n  h1: {{connection: local}}\nvars:\n  base: {_y(str(base))}\n")
    book = d / "play.yaml"
    book.write_text(PLAYBOOK_LITERAL.format(
        fname=_y(fname), dname=_y(dname), content=_y(content), marker=_y(marker), victim=_y(victim),
        when_true=_y(f"marker == {content!r}"), when_false=_y(f"marker != {content!r}"),
        argv_vars="\n".join(f"    a{i}: {_y(a)}" for i, a in enumerate(argv)),
        argv_refs=", ".join(f'"{{{{ a{i} }}}}"' for i in range(len(argv)))))
    old = os.getcwd()
    os.chdir(cwd)  # an injected `touch pwned` would land here
    try:
        report = Report(io.StringIO())
        inventory = load_inventory(inv)
        Runner(inventory, load_playbook(book), ["h1"], RunOptions(), report).run()
        again = Report(io.StringIO())
        Runner(load_inventory(inv), load_playbook(book), ["h1"], RunOptions(), again).run()
    finally:
        os.chdir(old)
    status = {r.task: r for r in report.results}
    assert [status[t].status for t in ("hostile directory", "hostile file", "never", "argv literal")] == \
        ["changed", "changed", "skipped", "changed"], [(r.task, r.status, r.msg) for r in report.results]
    assert status["hostile user name reaches getent quoted"].status == "failed"
    assert sorted(os.listdir(base)) == sorted([dname, "argv.out"])
    assert os.listdir(base / dname) == [fname]
    assert (base / dname / fname).read_bytes() == content.encode()
    assert oct((base / dname / fname).stat().st_mode & 0o777) == "0o600"
    assert (base / "argv.out").read_bytes().split(b"\0")[:-1] == [a.encode() for a in argv]
    assert list(cwd.iterdir()) == []
    assert not list(d.rglob("pwned"))
    assert again.hosts["h1"].changed == 0, [(r.task, r.status, r.msg) for r in again.results]


# -- the quoting primitives against /bin/sh -----------------------------------------------------------

@settings(max_examples=150, deadline=None, database=None)
@given(argv=st.lists(st.text().filter(lambda s: "\0" not in s), min_size=1, max_size=6))
@example(argv=["a'; touch pwned; '", "$(id)", "`id`", "\n", "", "-n", "'\"'\"'", "~", "*"])
def test_cmd_round_trips_through_sh(argv):
    out = subprocess.run(["/bin/sh", "-c", "printf '%s\\0' " + cmd(*argv)], capture_output=True, cwd="/",
                         timeout=10).stdout
    assert out.split(b"\0")[:-1] == [a.encode() for a in argv]


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.binary(max_size=4096))
@example(data=b"SPARKPROV_\n'EOF'\n$(touch /tmp/pwned)\n\x00\xff")
def test_heredoc_bytes_round_trips_any_bytes(data):
    out = subprocess.run(["/bin/sh", "-s"], input=heredoc_bytes(data, "cat").encode(), capture_output=True,
                         timeout=10).stdout
    assert out == data


@settings(max_examples=60, deadline=None, database=None)
@given(rest=hostile.filter(lambda s: "\0" not in s), home=st.one_of(st.none(), hostile.filter(lambda s: "\0" not in s).map(lambda s: "/h/" + s)))
def test_home_paths_are_one_shell_word(rest, home):
    word = ShellCtx(home).path("~/" + rest)
    script = f'__sp_home="/fallback/$(echo x)"; printf "%s" {word}'
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, timeout=10).stdout.decode()
    base = home.rstrip("/") if home else "/fallback/x"
    assert out == base + ("/" + rest if rest else "")


# -- regressions found by the tests above ------------------------------------------------------------

@pytest.mark.parametrize("expr", ["inventory_hostname < 5", "inventory_hostname in 5", "groups > []"])
def test_condition_over_values_that_do_not_compare_is_an_expr_error(expr):
    with pytest.raises(ExprError, match="cannot evaluate condition"):
        evaluate(expr, {"inventory_hostname": "h1", "groups": {}})


def test_deeply_nested_condition_is_an_expr_error():
    with pytest.raises(ExprError, match="nested too deeply"):
        evaluate("not " * 5000 + "x", {"x": True})


@pytest.mark.parametrize("var,value,want", [
    ("fabric_subnets", ["192.168.100.0/24", "not-a-subnet"], "'not-a-subnet', which is not a CIDR"),
    ("fabric_addresses", ["10.0.0.1/24; id", "10.0.1.1/24"], "'10.0.0.1/24; id', which is not a CIDR"),
    ("fabric_host_id", "eleven", "is not a whole number"),
])
def test_fabric_settings_that_do_not_parse_fail_the_task_with_a_message(var, value, want):
    """A bad fabric variable failed with a ValueError traceback out of the run. The inventory now
    refuses it at load (sparkprov/inventory_vars.py); a play variable reaches the module, whose
    reading raises the declaration's InputError, which the engine makes the task's one-line failure."""
    links = {i: {"mtu": 1500, "admin_up": True, "carrier": True, "ipv4": []} for i in ("enp1s0f1np1", "enP2p1s0f1np1")}
    facts = {fabric_facts.Ibdev2netdev().key: {"present": True, "devices": [
                 {"hca": "rocep1s0f1", "iface": "enp1s0f1np1", "up": True},
                 {"hca": "roceP2p1s0f1", "iface": "enP2p1s0f1np1", "up": True}]},
             fabric_facts.NetState().key: {"links": links, "routes": [], "ssh_server_addr": None, "netplan": True},
             PathState(fabric.NETPLAN_FILE, with_content=True).key: {"exists": False}}
    host = HostContext("spark1", {var: value, "groups": {"sparks": ["spark1", "spark2"]}},
                       {"user": "nvidia", "home": "/home/nvidia"}, check=False, exports={"spark1": {}, "spark2": {}},
                       play_hosts=["spark1", "spark2"], become=True)
    m = fabric.FabricModule()
    try:
        failed = m.plan(m.Args(), m.view(m.Args(), FactView(facts, {}), host), host).failed
    except InputError as exc:  # engine/run.py: the task fails with exc.line()
        failed = exc.line()
    assert failed and want in failed and var in failed and "\n" not in failed, failed


def test_input_error_line_escapes_every_line_break_and_escape_sequence():
    for ch in LINE_BREAKS + ["\x1b", "\x00", "\u202e"]:
        line = InputError(f"bad {ch} value", file="f.yaml", line=1, column=2, fix=f"fix {ch}").line()
        assert line.isprintable() and len(line.splitlines()) == 1, repr(line)
    assert InputError("café 日本", file="f.yaml", line=3).line() == "f.yaml:3: café 日本"
