"""ray_token: the Ray token of a deployment on each member, made once, the same everywhere, 0600.

A Ray cluster without authentication accepts any node or driver that reaches its GCS. With
RAY_AUTH_MODE=token (Ray 2.60: `ray/_private/authentication/`) every Ray process presents the
token it reads from RAY_AUTH_TOKEN_PATH; sparkprov mounts the file read-only into the Ray
containers (serving/spec.py), so neither an argv nor `docker inspect` holds the token.

Two phases, one play each: `make` on rank 0 (the token there, made from 256 random bits on the
control machine when absent, as `ray get-auth-token --generate` makes one), then `copy` on the
other members (rank 0's token, exported in the run's memory only). The token reaches a host inside
a script on stdin (printf is a builtin: no argv); the tasks run with no_log, diffs never show it.
"""

from __future__ import annotations

import secrets
from typing import Literal

from sparkprov.facts.serving import KeyFile, KeyText
from sparkprov.modules._serving import ServeArgs
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, Plan
from sparkprov.serving.spec import RAY_TOKEN_NAME
from sparkprov.transport.shell import quote



def token_path(deployment: str) -> str:
    """The token on a node, `~` the login user's home (spec.ray_token_file is the same, expanded)."""
    return f"~/.config/sparkprov/deployments/{deployment}/{RAY_TOKEN_NAME}"


def write_script(path: str, token: str) -> str:
    """Write the token 0600 in a 0700 directory, atomically; the token only on stdin (printf)."""
    rel = path[2:] if path.startswith("~/") else path
    return "\n".join([
        f'f="$HOME"/{quote(rel)}' if path.startswith("~/") else f"f={quote(path)}",
        'd=$(dirname "$f")', "umask 077", 'mkdir -p "$d"', 'chmod 700 "$d"',
        f"printf '%s' {quote(token)} > \"$f.new\"", 'chmod 600 "$f.new"', 'mv "$f.new" "$f"',
    ])


class Args(ServeArgs):
    phase: Literal["make", "copy"]


# rank 0's, for the copies (memory only, never reported: the task is no_log)
RAY_TOKEN: Export[dict[str, str]] = Export("ray_token", dict, "deployment -> its Ray token")


class RayToken(Module):
    name = "ray_token"
    Args = Args
    doc = "The Ray token of a deployment: made once on rank 0, the same 0600 file on every member (never shown)."

    def needs(self, args: Args, host: HostContext):
        p = token_path(args.deployment.name)
        return {"file": KeyFile(p), "token": KeyText(p)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        dep = args.deployment
        path = token_path(dep.name)
        have, info = facts.token, facts.file
        if args.phase == "make":
            want = have or secrets.token_hex(32)
        else:
            want = RAY_TOKEN.entry(host.exports, dep.hosts[0], dep.name)
            if not want:
                return Plan.fail(f"{host.name}: rank 0 ({dep.hosts[0]}) has no Ray token for {dep.name} "
                                 "(its ray token task failed)")
        exports = RAY_TOKEN({dep.name: want}) if args.phase == "make" else {}
        if have == want and info.get("mode") == 0o600:
            return Plan(msg=f"Ray token of {dep.name} in place (0600)", exports=exports)
        why = ("absent" if not info.get("exists") else "not rank 0's" if have != want
               else f"mode {info.get('mode', 0):o}")
        state = "0600, the deployment's token\n"
        change = Change(f"{'make' if not have and args.phase == 'make' else 'write'} the Ray token of {dep.name} "
                        f"({path}): {why}", write_script(path, want),
                        Diff(f"{host.name}: {path}", f"{why}\n", state),
                        touches=[facts.fact("file"), facts.fact("token")],
                        predicts=[(facts.fact("file"), {"exists": True, "mode": 0o600, "owner": host.user,
                                                        "size": len(want)}),
                                  (facts.fact("token"), want)])
        return Plan([change], exports=exports)
