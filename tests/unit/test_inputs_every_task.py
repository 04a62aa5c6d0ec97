"""Every task of tasks.py through the real command line (invoke's Program in process, as
test_inputs_properties.py runs it) with generated input that must be refused (issue 33):

- a value its option's declared kind does not accept (every option of every task that takes a
  value, the positional ones included), beside valid values of other options;
- options that contradict each other, or that the chosen form does not use: each rule the task's
  options class declares (Needs, Excludes, Form, Check), generated from the declaration;
- an inventory variable of the wrong type or range, for the tasks that read the inventory.

Each must end with exit 1 and exactly one printable line on stderr naming the option (both of them
for a contradiction), nothing on stdout, no traceback, nothing created or changed (the working folder
and HOME are temporary and compared before and after), and no host contacted: every socket connection
and name lookup is refused and recorded, so a run that got past its input would show here, and the
inventory's hosts are 127.0.0.1 port 9 besides.

The lab's tasks (lab.*) build network namespaces once their options parse: test_options.py covers
their refused values. `schema` takes no option. Hypothesis draws a bounded number of examples per
task, each under a deadline: the whole module runs in well under a minute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkprov import inventory_vars as iv
from sparkprov.options import (Check, Choice, Excludes, Files, Flag, Form, Hosts, Needs, Text, OptionError,
                               options_of)
from test_inputs_hostile_cli import snapshot
from test_inputs_properties import TASKS as TASKS_MODULE
from test_inputs_properties import invoke

# inventory files wrong in their connection settings or variables (every declared variable is also
# tried below, from the declaration itself); each wrong in type or range
BAD_INVENTORIES = [
    "defaults: {port: abc, connect_timeout: 1}\n",
    "defaults: {port: 9, connect_timeout: -1}\n",
    "defaults: {port: 9, connect_timeout: .nan}\n",
    "defaults: {port: 9}\nvars: {gateway_port: abc}\n",
    "defaults: {port: 9}\nvars: {serve_port: 70000}\n",
    "defaults: {port: 9}\nvars: {serve_port: true}\n",
    "defaults: {port: 9}\nvars: {hf_endpoint: 'ftp//x'}\n",
    "defaults: {port: 9}\nvars: {stage_image: 'a;b'}\n",
    "defaults: {port: 9}\nvars: {gateway_image: [a]}\n",
    "defaults: {port: 9}\nvars: {model_store: \"a\\nb\"}\n",
]
HOSTS = "hosts:\n  s1: {address: 127.0.0.1}\n  s2: {address: 127.0.0.1}\ngroups:\n  sparks: [s1, s2]\n"
GOOD_INVENTORY = "defaults: {port: 9, connect_timeout: 1}\nvars: {hf_endpoint: 'http://127.0.0.1:9'}\n" + HOSTS
PLAYBOOK = "- hosts: all\n  tasks:\n    - name: t\n      command: {argv: ['true']}\n      tags: [docker]\n"

# What each task's positional argument is given, first the value the generated runs use; the others
# choose forms of the command (a rule that holds in one form is violated in another).
POSITIONAL = {"play": ["{d}/good.yaml"], "stage-weights": ["org/name"], "bench": ["tp"],
              "gateway": ["up", "down"], "monitor": ["up", "write", "down"], "history": ["d"],
              "rollback": ["d"], "recipe": ["lab-tiny", "import"], "lint": ["lab-tiny", "all"],
              "plan": ["lab-tiny"]}
# Check rules (a rule of its own) are violated by these (the words after the task)
CHECKS = {"provision": [["--tags=docker", "--skip-tags=docker"]],
          "play": [["{d}/good.yaml", "--tags=docker", "--skip-tags=docker"]],
          "recipe": [["import"]]}  # `recipe import` without --file
# the runs that read the inventory first: (positional, extra options)
READS_INVENTORY = {"recipe": ["--host=s1"], "lint": ["--host=s1"], "images": ["--host=s1"],
                   "plan": ["--hosts=s1"]}
NO_INVENTORY = {"models"}

TASKS = {t.name.replace("_", "-"): t for t in TASKS_MODULE.TASKS if hasattr(t, "options")}
# every value the pool offers, for every kind: the kind itself says which it accepts
POOL = ["", " ", "0", "1", "2", "4", "64", "65", "1024", "1025", "-1", "1.5", "2.5", "1e3", "0x10", "nan", "inf",
        "٣", "abc", "a b", "a;b", "a,b", ",", "s1", "s2", "sparks", "s1,s2", "s1,s1", "!s1", "nosuch", "org/name",
        "org/name@main", "../main", "main", "*.json", "original/*", "docker", "up", "down", "write", "ray", "native",
        "auto", "peer", "smoke", "bench", "nccl", "gloo", "arena", "15s", "15", "1M", "2G", "2X",
        "vllm/vllm-openai:v0.19.1", "-v /:/host", "UPPER/x", "127.0.0.1", "0.0.0.0", "everywhere", "lab-tiny",
        "a\nb", "a\rb", "\x1b[31m", "\u2028", "$(id)", "x" * 5000, "{d}/good.yaml", "{d}/out"]
INVOKE_PARSER = re.compile(r"Flag <Argument: [a-z_]+(?: \([a-z]\))?> needed value and was not given one!")
SETTINGS = settings(max_examples=12, deadline=timedelta(seconds=20), database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])


def accepts(kind, value: str) -> bool:
    try:
        kind.parse("x", [value] if kind.many else value)
    except OptionError:
        return False
    return True


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def given_as(f: dataclasses.Field, value) -> list[str]:
    """The argv words that give option `f` (not positional) `value`; a flag turned from its default."""
    if f.metadata["kind"].flag:
        return [flag(f.name) if not f.default else "--no-" + f.name.replace("_", "-")]
    return [f"{flag(f.name)}={value}"]


def without_rules(cls, words: dict[str, str]):
    """The options object as parse_options would make it, its rules not checked."""
    values = {}
    for f in options_of(cls):
        kind = f.metadata["kind"]
        raw = words.get(f.name)
        if raw is None:
            values[f.name] = f.default if not kind.many else []
        else:
            values[f.name] = (not f.default) if kind.flag else kind.parse(f.name, [raw] if kind.many else raw)
    return cls(**values)


@contextlib.contextmanager
def no_network():
    """Every connection and name lookup refused, and recorded: a run must never get that far."""
    tried: list[str] = []

    def refuse(*args, **kw):
        tried.append(repr(args[:2]))
        raise OSError("network refused by the test")

    saved = (socket.socket.connect, socket.socket.connect_ex, socket.create_connection, socket.getaddrinfo)
    socket.socket.connect = socket.socket.connect_ex = refuse
    socket.create_connection = socket.getaddrinfo = refuse
    try:
        yield tried
    finally:
        socket.socket.connect, socket.socket.connect_ex, socket.create_connection, socket.getaddrinfo = saved


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A working folder and HOME with the inventories and a playbook the runs name."""
    d = tmp_path_factory.mktemp("every-task")
    (d / "home").mkdir()
    (d / "inventory.yaml").write_text(GOOD_INVENTORY)
    (d / "good.yaml").write_text(PLAYBOOK)
    for i, bad in enumerate(BAD_INVENTORIES):
        (d / f"bad{i}.yaml").write_text(bad + HOSTS)
    return d


def run_refused(place: Path, argv: list[str], *names: str) -> str:
    """`invoke ARGV` must refuse: exit 1, one line naming `names`, nothing else printed, nothing
    touched, no connection tried."""
    argv = [a.replace("{d}", str(place)) for a in argv]
    before = snapshot(place)
    env = {"HOME": str(place / "home"), "HF_TOKEN_PATH": str(place / "no-token")}
    saved = {k: os.environ.get(k) for k in (*env, "SPARKPROV_INVENTORY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    cwd = os.getcwd()
    try:
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(env)
        os.chdir(place)
        with no_network() as tried:
            code, out, err = invoke(*argv)
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert "Traceback" not in out + err, (argv, out, err)
    assert tried == [], (argv, tried, err)  # a host (or the hub) would have been contacted
    assert code == 1, (argv, code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].isprintable(), (argv, err)
    assert out == "", (argv, out)
    if not lines[0].startswith("sparkprov: "):
        # invoke's own argv parser, before any task runs: a value that reads as a flag (`--tp=-a` is
        # `--tp` followed by `-a`) is refused by it in one line that names the option
        assert INVOKE_PARSER.fullmatch(lines[0]), (argv, lines[0])
        return lines[0]
    for name in names:
        assert name in lines[0], (argv, name, lines[0])
    assert snapshot(place) == before, argv
    return lines[0]


def base(task: str, positional: str | None = None) -> list[str]:
    first = POSITIONAL.get(task)
    return [task] + ([positional or first[0]] if first else []) + (
        [] if task in NO_INVENTORY else ["--inventory={d}/inventory.yaml"])


# -- a value an option's kind does not accept ---------------------------------------------------------


@st.composite
def bad_value_runs(draw, task: str):
    cls = TASKS[task].options
    fields = [f for f in options_of(cls) if not f.metadata["kind"].flag]
    bad = draw(st.sampled_from(fields))
    kind = bad.metadata["kind"]
    value = draw(st.one_of(st.sampled_from(POOL), st.text(max_size=8)).filter(
        # ({d} stands for the working folder, filled in only when the run starts: never a bad value)
        lambda v: "{d}" not in v and not accepts(kind, v) and not (bad.metadata["positional"] and v.startswith("-"))))
    others = draw(st.lists(st.sampled_from([f for f in options_of(cls) if f is not bad and not f.metadata["positional"]
                                            and f.name != "inventory"]), max_size=3, unique_by=lambda f: f.name))
    words = []
    for f in others:
        good = [v for v in POOL if accepts(f.metadata["kind"], v.replace("{d}", "/tmp"))]
        if good or f.metadata["kind"].flag:
            words += given_as(f, draw(st.sampled_from(good)) if good else None)
    if bad.metadata["positional"]:
        argv = [task, value] + (["--inventory={d}/inventory.yaml"] if task not in NO_INVENTORY else [])
    else:
        head = [a for a in base(task) if not (bad.name == "inventory" and a.startswith("--inventory="))]
        argv = head + words + [f"{flag(bad.name)}={value}"]
    return argv, bad


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_value_no_option_accepts_is_one_line_before_anything(place, task):
    @SETTINGS
    @given(run=bad_value_runs(task))
    def check(run):
        argv, bad = run
        line = run_refused(place, argv)
        # the option by its name; a positional one out of place, by the task's
        assert (flag(bad.name) in line or f"<Argument: {bad.name}" in line
                or (bad.metadata["positional"] and f"{task}: " in line)), line

    check()


# -- options that contradict each other, or that the form does not use -------------------------------


def violations(task: str) -> list[tuple[list[str], tuple[str, ...]]]:
    """Per rule of the task's options: an argv that breaks it, and what the line must name."""
    cls = TASKS[task].options
    fields = {f.name: f for f in options_of(cls)}
    valid = {n: next((v for v in POOL if accepts(f.metadata["kind"], v.replace("{d}", "/tmp"))), None)
             for n, f in fields.items()}
    out = []
    for rule in getattr(cls, "RULES", ()):
        for pos in POSITIONAL.get(task, [None]):
            head = [pos] if pos else []
            first = next((f.name for f in fields.values() if f.metadata["positional"]), None)
            words = {first: pos} if first else {}
            if isinstance(rule, Needs):
                o = without_rules(cls, {**words, rule.option: valid[rule.option] or "x"})
                if not rule.when(o):
                    out.append(([task, *head, *given_as(fields[rule.option], valid[rule.option])],
                                (flag(rule.option), rule.needed)))
                    break
            elif isinstance(rule, Excludes):
                out.append(([task, *head, *given_as(fields[rule.a], valid[rule.a]),
                             *given_as(fields[rule.b], valid[rule.b])], (flag(rule.a), flag(rule.b))))
                break
            elif isinstance(rule, Form):
                # the form is chosen by the positional argument, or by an option (bench --export)
                chosen = next((sel for sel in [None, *fields] if rule.when(without_rules(
                    cls, {**words, **({sel: valid[sel] or "x"} if sel else {})}))), False)
                if chosen is not False:
                    extra = next(n for n, f in fields.items() if n not in rule.uses and not f.metadata["positional"]
                                 and (valid[n] is not None or f.metadata["kind"].flag))
                    selector = given_as(fields[chosen], valid[chosen]) if chosen else []
                    out.append(([task, *head, *selector, *given_as(fields[extra], valid[extra])],
                                (flag(extra), rule.name)))
                    break
            elif isinstance(rule, Check):
                out += [([task, *words], ()) for words in CHECKS[task]]
                break
        else:
            raise AssertionError(f"{task}: no form breaks {rule}")  # the generator must cover every rule
    return out


RULE_RUNS = [(task, argv, names) for task in sorted(TASKS) for argv, names in violations(task)]


@pytest.mark.parametrize("task,argv,names", RULE_RUNS, ids=[" ".join(a)[:70] for _, a, _ in RULE_RUNS])
def test_a_broken_rule_is_one_line_naming_both(place, task, argv, names):
    run_refused(place, argv, *names)


def test_every_declared_rule_is_broken_once():
    """The runs above cover each rule of each task (a rule added later is covered, or this fails)."""
    counted = sum(len(getattr(TASKS[t].options, "RULES", ())) for t in TASKS)
    assert counted and len(RULE_RUNS) >= counted


# -- an inventory variable of the wrong type or range ---------------------------------------------------


@pytest.mark.parametrize("task", sorted(set(TASKS) - NO_INVENTORY))
def test_a_wrong_inventory_variable_is_one_line_before_any_host(place, task):
    @SETTINGS
    @given(i=st.integers(0, len(BAD_INVENTORIES) - 1))
    def check(i):
        argv = [a for a in base(task) if not a.startswith("--inventory=")]
        run_refused(place, [*argv, *READS_INVENTORY.get(task, []), f"--inventory={{d}}/bad{i}.yaml"],
                    f"bad{i}.yaml:")

    check()


# Every variable of the inventory declaration (sparkprov/inventory_vars.py), with a value its own kind
# refuses (the first of these that it does): the inventory is refused at that variable's line.
WRONG_VALUES = [True, "abc", -1, 1e9, float("nan"), [1, 2], {"a": 1}, "a\nb", "$(id)", "", 0, 70000, "1.5", "-x y"]


def _refused_value(var):
    for v in WRONG_VALUES:
        try:
            var.check(v)
        except ValueError:
            return v
    return None


DECLARED = sorted(iv.VARS.values(), key=lambda v: v.name)


@pytest.mark.parametrize("var", DECLARED, ids=lambda v: v.name)
def test_every_declared_variable_of_a_wrong_kind_is_one_line_before_any_host(place, var):
    bad = _refused_value(var)
    path = place / f"var-{var.name}.yaml"
    path.write_text(yaml.safe_dump({"defaults": {"port": 9}, "vars": {var.name: bad}}) + HOSTS)

    @settings(SETTINGS, max_examples=3)
    @given(task=st.sampled_from(sorted(set(TASKS) - NO_INVENTORY)))
    def check(task):
        argv = [a for a in base(task) if not a.startswith("--inventory=")]
        run_refused(place, [*argv, *READS_INVENTORY.get(task, []), f"--inventory={path}"], f"{path.name}:", var.name)

    check()


def test_every_declared_variable_has_a_value_its_kind_refuses():
    """The generator above reaches every variable (a kind that accepts every wrong value offered is
    missed by it: add one it refuses)."""
    assert [v.name for v in DECLARED if _refused_value(v) is None] == []


def test_the_generators_reach_every_task_and_option():
    """Every task but the lab's and `schema` is here, and every option that takes a value has a value
    its kind refuses in the pool (else the property above would skip it)."""
    names = {t.name.replace("_", "-") for t in TASKS_MODULE.TASKS}
    assert names - set(TASKS) == {"schema"}
    for task, t in TASKS.items():
        for f in options_of(t.options):
            kind = f.metadata["kind"]
            if not kind.flag:
                assert any(not accepts(kind, v) for v in POOL), (task, f.name)
    assert {type(f.metadata["kind"]) for t in TASKS.values() for f in options_of(t.options)} >= {
        Choice, Files, Flag, Hosts, Text}


# -- the cases found by hand (issue 33), each as it was written there ------------------------------------

KNOWN = [
    # options silently ignored or contradicting each other
    (["status", "--ports", "--count", "3"], "--count needs --watch"),
    (["monitor", "down", "--out", "x"], "--out does nothing in monitor down"),
    (["monitor", "write", "--host", "s1"], "--host does nothing in monitor write"),
    (["monitor", "write", "--json"], "--json does nothing in monitor write"),
    (["monitor", "up", "--out", "x"], "--out does nothing in monitor up"),
    (["gateway", "down", "--port", "3"], "--port does nothing in gateway down"),
    (["recipe", "lab-tiny", "--hosts", "s1,s2"], "--hosts needs --tp, --pp or --dp above 1"),
    (["recipe", "lab-tiny", "--argv", "--systemd"], "--argv and --systemd both choose what is printed"),
    (["recipe", "lab-tiny", "--host", "s1", "--tp", "2", "--hosts", "s1,s2"], "--host and --hosts are both given"),
    (["recipe", "lab-tiny", "--file", "x.yaml"], "--file needs `recipe import`"),
    (["recipe", "import", "--file", "x.yaml", "--tp", "2"], "--tp does nothing in recipe import"),
    (["bench", "tp", "--export", "x.yaml", "--compare"], "--compare does nothing in bench --export"),
    (["bench", "tp", "--export", "x.yaml", "--hosts", "s1"], "--hosts does nothing in bench --export"),
    (["lint", "all", "--tp", "2"], "--tp needs one alias"),
    (["images", "--out", "x.yaml"], "--out needs --pin"),
    (["images", "--flags"], "--flags needs --host"),
    (["plan", "lab-tiny", "--inventory", "{d}/inventory.yaml"], "--inventory needs --hosts"),
    (["lint", "lab-tiny", "--inventory", "{d}/inventory.yaml"], "--inventory needs --host"),
    (["cluster-up", "--pp", "2"], "--pp needs --model"),
    (["cluster-up", "--model", "lab-tiny", "--playbook", "x.yaml"], "--model and --playbook"),
    (["cluster-up", "--model", "lab-tiny", "--deployments", "a"], "--model and --deployments"),
    (["nccl-check", "--image", "vllm/vllm-openai:v0.19.1", "--playbook", "x.yaml"], "--image and --playbook"),
    (["provision", "--tags", "docker", "--skip-tags", "docker"], "--tags and --skip-tags both name 'docker'"),
    # a host named twice: a TP 2 layout with rank 0 only, wherever a host list is taken
    (["recipe", "lab-tiny", "--tp", "2", "--hosts", "s1,s1"], "--hosts 's1,s1' names 's1' twice"),
    (["cluster-up", "--model", "lab-tiny", "--tp", "2", "--hosts", "s1,s1"], "names 's1' twice"),
    (["nccl-check", "--hosts", "s1,s1"], "names 's1' twice"),
    (["provision", "--limit", "s2,s2"], "--limit 's2,s2' names 's2' twice"),
    # checked only after hosts answered, or never
    (["stage-weights", "org/name", "--image", "a;b"], "--image 'a;b' is not an image reference"),
    (["nccl-check", "--image", "a;b"], "--image 'a;b' is not an image reference"),
    (["play", "x\r.yaml"], "--playbook 'x\\r.yaml': control characters"),
    (["provision", "--playbook", "x\r.yaml"], "--playbook 'x\\r.yaml': control characters"),
    (["cluster-up", "--playbook", "x\r.yaml"], "--playbook 'x\\r.yaml': control characters"),
]


@pytest.mark.parametrize("argv,words", KNOWN, ids=[" ".join(a)[:60] for a, _ in KNOWN])
def test_a_known_contradiction_or_bad_value_is_one_line(place, argv, words):
    inventory = [] if argv[0] in ("recipe", "lint", "plan", "images") else ["--inventory={d}/inventory.yaml"]
    run_refused(place, [*argv, *inventory], words)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_invoke_help_shows_every_option(task):
    code, out, err = invoke("--help", task)
    assert code == 0, err
    for f in options_of(TASKS[task].options):
        if not f.metadata["positional"]:  # a switch on by default shows as --[no-]NAME
            shown = "--[no-]" + f.name.replace("_", "-") if f.metadata["kind"].flag and f.default else flag(f.name)
            assert shown in out, (task, f.name)
