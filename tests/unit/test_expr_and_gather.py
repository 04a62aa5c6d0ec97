"""Templating, conditions, and the gather script's framing (real shell, hostile output)."""

import pytest

from sparkprov.engine.expr import ExprError, Undefined, evaluate, render
from sparkprov.facts.base import Fact, FactError, HostInfo, ShellCtx
from sparkprov.engine.gather import build_gather, parse_gather
from sparkprov.transport.local import LocalTransport
from dataclasses import dataclass


def test_render_keeps_types_and_substitutes_inside_strings():
    v = {"ifaces": ["a", "b"], "n": 3, "store": "/home/u/vllm", "d": {"k": "v"}}
    assert render("{{ ifaces }}", v) == ["a", "b"]
    assert render({"p": "{{ store }}/hub", "n": "{{n}}"}, v) == {"p": "/home/u/vllm/hub", "n": 3}
    assert render("{{ d.k }}", v) == "v"
    with pytest.raises(Undefined):
        render("{{ nope }}", v)


@pytest.mark.parametrize("expr,expected", [
    ("arch == 'aarch64'", True), ("arch != 'aarch64'", False), ("'spark1' in hosts", True),
    ("n > 2 and not flag", True), ("flag or n < 1", False), ("info.cc == '12.1'", True), ("true", True),
])
def test_conditions(expr, expected):
    v = {"arch": "aarch64", "hosts": ["spark1"], "n": 3, "flag": False, "info": {"cc": "12.1"}}
    assert evaluate(expr, v) is expected


@pytest.mark.parametrize("expr", ["__import__('os')", "open('/etc/passwd')", "x.__class__", "[i for i in y]",
                                  "lambda: 1", "a + b"])
def test_conditions_reject_code(expr):
    with pytest.raises(ExprError):
        evaluate(expr, {"x": 1, "y": [1], "a": 1, "b": 2})


@dataclass(frozen=True)
class Echo(Fact):
    text: str

    def command(self, sh):
        from sparkprov.transport.shell import cmd
        return cmd("printf", "%s", self.text) + "; echo oops >&2; exit 3"

    def parse(self, out, err, rc):
        if rc != 3:
            raise FactError("unexpected rc")
        return {"out": out, "err": err}


def test_gather_framing_survives_hostile_output():
    # Output that imitates our markers, quotes, $() and newlines: all come back verbatim.
    nasty = "\n@@SP:deadbeef:0:E:0\nA\n$(touch /tmp/pwned) `id` ; rm -rf / 'q\" \n\n"
    facts = [HostInfo(), Echo(nasty), Echo("")]
    gs = build_gather(facts, ShellCtx(None), become=False, password=None, probe_become=False)
    res = LocalTransport("local").run_script(gs.script)
    parsed = parse_gather(gs, res.stdout)
    assert parsed.errors == {}
    assert parsed.values[Echo(nasty).key] == {"out": nasty, "err": "oops"}  # stderr loses trailing newlines (command substitution)
    assert parsed.values[Echo("").key]["out"] == ""
    assert parsed.values[HostInfo().key]["user"]


@dataclass(frozen=True)
class RootEcho(Echo):
    needs_root = True


def test_root_facts_share_one_root_shell_and_keep_their_framing(monkeypatch):
    """Facts that need root run in one root shell per gather (chunked under the argument size
    limit); each keeps its own output, stderr and exit status, in between the user's facts.
    Run as root here, so that the root shell is the script's own (`__sp_root "$@"`)."""
    import sparkprov.engine.gather as gather

    monkeypatch.setattr(gather, "ROOT_BLOCK_BYTES", 60)  # several root shells for the facts below
    nasty = "it's $(id) `x` \n@@SP:0:0:E:0"
    facts = [RootEcho("r1"), Echo("u1"), RootEcho(nasty), RootEcho("r3 " + "x" * 100), HostInfo()]
    gs = build_gather(facts, ShellCtx(None), become=True, password=None, probe_become=True)
    assert gs.script.count("__sp_root sh -c") == 3
    res = LocalTransport("local").run_script(gs.script)
    parsed = parse_gather(gs, res.stdout)
    assert parsed.errors == {}
    assert parsed.become == "root"
    assert parsed.values[RootEcho(nasty).key] == {"out": nasty, "err": "oops"}
    assert parsed.values[RootEcho("r1").key]["out"] == "r1"
    assert parsed.values[Echo("u1").key]["out"] == "u1"


def test_a_refused_root_shell_fails_each_root_fact_with_sudos_answer():
    """When becoming root fails, every fact that needed it fails with that reason and exit status
    (as when each ran its own sudo); the user's facts are read all the same."""
    facts = [RootEcho("r1"), Echo("u1"), RootEcho("r2")]
    gs = build_gather(facts, ShellCtx(None), become=True, password=None, probe_become=False)
    refused = 'sudo() { echo "sudo: a password is required" >&2; return 1; }\nid() { [ "$1" = -u ] && echo 1000 || command id "$@"; }\n'
    res = LocalTransport("local").run_script(refused + gs.script)
    parsed = parse_gather(gs, res.stdout)
    assert parsed.values[Echo("u1").key]["out"] == "u1"
    for f in (RootEcho("r1"), RootEcho("r2")):
        assert parsed.errors[f.key] == "unexpected rc"  # the fact's own parse saw rc 97, not its 3


def test_shell_ctx_expands_home_without_quoting_it_away():
    assert ShellCtx("/home/nvidia").path("~/vllm") == "/home/nvidia/vllm"
    assert ShellCtx("/home/n v").path("~/a b") == "'/home/n v/a b'"
    assert ShellCtx(None).path("~/a b") == "\"$__sp_home\"'/a b'"
