"""Helpers shared by unit tests (imported as `helpers`: pytest puts this folder on sys.path)."""

import textwrap

# Hosts nothing listens for: if a run tried to reach them it would say "unreachable" (exit 4)
# instead of the input error a test expects.
SAFE_INVENTORY = """
defaults: {port: 9, connect_timeout: 1}
hosts:
  s1: {address: 127.0.0.1}
  s2: {address: 127.0.0.1}
groups:
  sparks: [s1, s2]
"""


def one(findings, severity):
    """The single lint finding, of this severity."""
    assert len(findings) == 1, [f.line() for f in findings]
    assert findings[0].severity == severity, findings[0].line()
    return findings[0]


def user(base, body=""):
    """A user recipe file with one recipe `broken` extending `base`."""
    return f"recipes:\n  - alias: broken\n    extends: {base}\n" + textwrap.indent(textwrap.dedent(body), "    ")


def local_stage_inventory(d, server, monkeypatch, **vars):
    """An inventory of the control machine alone (connection: local) with these vars, staging from
    `server`, with no Hugging Face token in sight."""
    inv = d / "inventory.yaml"
    inv.write_text("hosts:\n  localhost: {connection: local}\nvars:\n"
                   + "".join(f"  {k}: {v}\n" for k, v in vars.items()) + f"  hf_endpoint: {server.url}\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(d / "no-token"))
    return inv


def refused(call) -> str:
    """Run a task that must refuse its input: exit 1, one printable line with the fix, nothing
    printed on stdout before it (no table, no PLAY). The line, without "sparkprov: "."""
    import contextlib
    import io

    import pytest
    from invoke import Exit

    out = io.StringIO()
    with pytest.raises(Exit) as err, contextlib.redirect_stdout(out):
        call()
    msg = err.value.message
    assert err.value.code == 1, msg
    assert msg.startswith("sparkprov: ") and msg.isprintable() and len(msg.splitlines()) == 1, msg
    assert "(fix: " in msg
    assert out.getvalue() == ""
    return msg.removeprefix("sparkprov: ")
