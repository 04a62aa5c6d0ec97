"""The gather: one script that reads many facts on a host in one remote call (sections framed
with a per-run nonce, stderr base64'd, the sudo probe inside the same script), and `invoke facts`
(gather_facts: facts from hosts without a playbook).
"""

from __future__ import annotations

import base64
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, TypedDict

from sparkprov.errors import SparkprovError
from sparkprov.facts.base import Fact, FactError, ShellCtx, home_of
from sparkprov.hosts import Inventory
from sparkprov.transport.connect import make_transport
from sparkprov.transport.shell import quote

# -- the gather script ----------------------------------------------------------------------

# One section: its stdout as is, its exit status, its stderr base64'd (any bytes, one line).
_SECTION_FN = r"""__sp_sec() {
  printf '\n@@SP:%s:%s:B\n' "$__sp_n" "$1"
  __sp_err=$( { "$2"; } 2>&1 1>&3 ); __sp_rc=$?
  printf '\n@@SP:%s:%s:E:%s\n' "$__sp_n" "$1" "$__sp_rc"
  [ -z "$__sp_err" ] || printf '%s' "$__sp_err" | base64 | tr -d '\n'; printf '\n'
}
"""

# Every process a gather starts, it starts on every host (16 Sparks: 16 times, on hosts that
# may be busy serving): the framing above spawns base64 only for a section that wrote to
# stderr, and the login user's name, uid and home are read once, here.
_PREAMBLE = r"""__sp_n=%(nonce)s
__sp_user=$(id -un); __sp_uid=$(id -u)
%(home)s
[ -n "$__sp_home" ] || __sp_home=$HOME
exec 3>&1
""" + _SECTION_FN.replace("%", "%%")

# How the script becomes root for the facts that need it; prints how it did on request. With a
# password, the root block's own sudo is the check (each PAM password check costs CPU: one per
# gather, not two). The root shell always exits 0, so a non-zero status there is sudo refusing
# (a wrong password, or a user sudo does not know): one failed attempt, as with a probe. Only
# when no fact needs root does __sp_checkpw ask sudo on its own.
_ROOT = r"""if [ "$__sp_uid" = 0 ]; then __sp_how=root; __sp_root() { "$@"; }
elif ! command -v sudo >/dev/null 2>&1; then __sp_how=nosudo; __sp_root() { echo "sudo is not installed" >&2; return 97; }
elif sudo -n true 2>/dev/null; then __sp_how=nopasswd; __sp_root() { sudo -n -H "$@"; }
elif [ -n "${__sp_has_pw:-}" ]; then __sp_how=password-unchecked; __sp_root() { __sp_pw | sudo -k -S -p '' -H "$@"; }
else __sp_how=password-needed; __sp_root() { echo "sudo needs a password" >&2; return 97; }
fi
__sp_pwbad() { __sp_how=password-bad; __sp_root() { echo "sudo password rejected" >&2; return 97; }; }
__sp_checkpw() {
  [ "$__sp_how" = password-unchecked ] || return 0
  if __sp_pw | sudo -k -S -p '' true 2>/dev/null; then __sp_how=password-ok; else __sp_pwbad; fi
}
"""

_SECTION_RE = r"\n@@SP:{n}:(\d+):B\n(.*?)\n@@SP:{n}:\1:E:(\d+)\n([A-Za-z0-9+/=]*)\n"


@dataclass
class GatherScript:
    script: str
    nonce: str
    facts: list[Fact]
    probe_become: bool


def build_gather(facts: Iterable[Fact], sh: ShellCtx, *, become: bool, password: str | None,
                 probe_become: bool) -> GatherScript:
    """One script that reads every fact. `become`: facts marked needs_root run as root."""
    nonce = secrets.token_hex(8)
    facts = list(facts)
    parts = [_PREAMBLE % {"nonce": nonce, "home": home_of("__sp_home", '"$__sp_user"')}]
    if become or probe_become:
        if password is not None:
            # printf is a shell builtin: the password never appears in any argv.
            parts.append(f"__sp_has_pw=1\n__sp_pw() {{ printf '%s\\n' {quote(password)}; }}\n")
        parts.append(_ROOT)
    as_root = [i for i, f in enumerate(facts) if f.needs_root and become]
    for i, fact in enumerate(facts):
        if i not in as_root:
            parts.append(_section(i, fact.command(sh)))
    chunk: list[tuple[int, str]] = []
    for i in as_root:
        body = facts[i].command(sh)
        # Linux caps one argument at 128 KiB (MAX_ARG_STRLEN): a huge play gets a few root shells
        if chunk and sum(len(b) for _, b in chunk) + len(body) > ROOT_BLOCK_BYTES:
            parts.append(_root_block(nonce, chunk))
            chunk = []
        chunk.append((i, body))
    if chunk:
        parts.append(_root_block(nonce, chunk))
    if probe_become:
        parts.append("__sp_checkpw\nprintf '\\n@@SP:%s:become:%s\\n' \"$__sp_n\" \"$__sp_how\"\n")
    return GatherScript("".join(parts), nonce, facts, probe_become)


ROOT_BLOCK_BYTES = 64 * 1024


def _section(i: int, body: str) -> str:
    return f"__sp_f{i}() {{\n{body}\n}}\n__sp_sec {i} __sp_f{i}\n"


def _root_block(nonce: str, sections: list[tuple[int, str]]) -> str:
    """Every fact that needs root, read by ONE root shell: one sudo (and one password check by
    PAM) per gather, not one per fact; 16 hosts x 9 password checks cost seconds of CPU. sudo
    resets the environment and closes other descriptors: the root shell gets the login user's
    home as $1 and sets up its own framing. If sudo itself fails, each of these sections gets
    sudo's exit status and message, as when each fact ran its own sudo."""
    inner = [f"__sp_n={nonce}\n__sp_home=$1\nexec 3>&1\n", _SECTION_FN]
    inner += [_section(i, body) for i, body in sections]
    indexes = " ".join(str(i) for i, _ in sections)
    return ("__sp_rerr=$( { __sp_root sh -c " + quote("".join(inner) + "exit 0\n") + ' sh "$__sp_home"; } 2>&1 1>&3 )'
            "; __sp_rrc=$?\n"
            'if [ $__sp_rrc -eq 0 ]; then [ "$__sp_how" = password-unchecked ] && __sp_how=password-ok\n'
            'elif [ "$__sp_how" = password-unchecked ]; then __sp_pwbad; __sp_rerr="sudo password rejected"; __sp_rrc=97\n'
            'fi\n'
            f"if [ $__sp_rrc -ne 0 ]; then for __sp_i in {indexes}; do\n"
            "  printf '\\n@@SP:%s:%s:B\\n\\n@@SP:%s:%s:E:%s\\n' \"$__sp_n\" $__sp_i \"$__sp_n\" $__sp_i $__sp_rrc\n"
            "  printf '%s' \"$__sp_rerr\" | base64 | tr -d '\\n'; printf '\\n'\n"
            "done; fi\n")


@dataclass
class GatherResult:
    values: dict[tuple, Any]
    errors: dict[tuple, str]
    become: str | None


def parse_gather(gs: GatherScript, stdout: str) -> GatherResult:
    values: dict[tuple, Any] = {}
    errors: dict[tuple, str] = {}
    found: dict[int, tuple[str, int, str]] = {}
    for m in re.finditer(_SECTION_RE.format(n=re.escape(gs.nonce)), stdout, re.S):
        err = base64.b64decode(m.group(4)).decode(errors="replace") if m.group(4) else ""
        found[int(m.group(1))] = (m.group(2), int(m.group(3)), err)
    for i, fact in enumerate(gs.facts):
        if i not in found:
            errors[fact.key] = "no output (the gather script stopped early)"
            continue
        out, rc, err = found[i]
        try:
            values[fact.key] = fact.parse(out, err, rc)
        except FactError as exc:
            errors[fact.key] = str(exc)
        except (ValueError, KeyError, IndexError) as exc:
            errors[fact.key] = f"cannot parse {fact}: {exc}"
    how = None
    if gs.probe_become:
        m = re.search(rf"\n@@SP:{re.escape(gs.nonce)}:become:([a-z-]+)\n", stdout)
        how = m.group(1) if m else None
    return GatherResult(values, errors, how)


class _HostFacts(TypedDict):
    ok: bool                   # every fact was read
    facts: dict[str, Any]      # section -> its parsed value
    errors: dict[str, str]     # section -> why it could not be read ("connect": the host)
    remote_calls: int


class HostFacts(_HostFacts, total=False):
    unreachable: bool


def gather_facts(inventory: Inventory, hosts: list[str], facts: dict[str, Fact], *, forks: int = 32,
                 accept_new_host_keys: bool = False) -> dict[str, HostFacts]:
    """host -> what was read there: the facts by their section names, and why others were not."""

    def one(name: str) -> tuple[str, HostFacts]:
        transport = make_transport(inventory.hosts[name], accept_new_host_keys)
        try:
            transport.connect()
            gs = build_gather(list(facts.values()), ShellCtx(None), become=False, password=None, probe_become=False)
            res = transport.run_script(gs.script)
            parsed = parse_gather(gs, res.stdout)
            out = {section: parsed.values[f.key] for section, f in facts.items() if f.key in parsed.values}
            errs = {section: parsed.errors[f.key] for section, f in facts.items() if f.key in parsed.errors}
            return name, {"ok": not errs, "facts": out, "errors": errs, "remote_calls": transport.remote_calls}
        except SparkprovError as exc:
            return name, {"ok": False, "unreachable": True, "facts": {}, "errors": {"connect": exc.line()},
                          "remote_calls": transport.remote_calls}
        finally:
            transport.close()

    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(hosts)))) as pool:
        return dict(pool.map(one, hosts))
