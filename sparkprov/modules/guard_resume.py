"""guard_resume: a node guard that stood down (its restart budget spent, or a crash loop) guards and
restarts again: `invoke guard --resume`. The guard reads the request at its next sample (a file it
removes, sparkprov/node/guard.py RESUME_PATH), journals a `resume` event, counts restarts from then
and starts what it holds stopped once memory allows. Read again afterwards: the guard no longer
stood down. A guard that did not stand down has nothing to resume; one that is not running cannot.
"""

from __future__ import annotations

from sparkprov.facts.files import PathState
from sparkprov.facts.guard import GuardState, guard_summary
from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.node import guard as g
from sparkprov.transport.shell import quote

TAKEN_WITHIN_S = 30   # the guard samples every second or few: it takes the request well within this


class Args(ModuleArgs):
    pass


def resume_script() -> str:
    """Leave the request, and wait until the guard has taken it (it removes the file)."""
    path = quote(g.RESUME_PATH)
    tries = int(TAKEN_WITHIN_S * 2)
    return "\n".join([f"mkdir -p {quote(g.RESUME_PATH.rsplit('/', 1)[0])}", f"date +%s > {path}",
                      f"for i in $(seq {tries}); do [ -e {path} ] || exit 0; sleep 0.5; done",
                      f"rm -f {path}; echo 'the guard did not take the request within {TAKEN_WITHIN_S}s' >&2; exit 1"])


class GuardResume(Module):
    name = "guard_resume"
    Args = Args
    doc = "Ask a node guard that stood down to guard and restart again (invoke guard --resume)."

    def needs(self, args: Args, host: HostContext):
        return {"guard": GuardState(**g.paths()), "request": PathState(g.RESUME_PATH)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        s = guard_summary(facts.guard)
        if not s["installed"]:
            return Plan(msg="no guard (invoke provision installs it)")
        if not s["stood_down"]:
            held = ", ".join(sorted(s["held"]))
            return Plan(msg="the guard has not stood down: nothing to resume"
                        + (f" (it holds {held} stopped and starts them once memory allows)" if held else ""))
        if not s["running"]:
            return Plan.fail(f"{host.name}: the guard stood down ({s['stood_down'].get('why')}) and is not running: "
                             "invoke provision starts it, then invoke guard --resume")
        held = ", ".join(sorted(s["held"])) or "nothing"
        return Plan([Change(f"resume the guard (stood down: {s['stood_down'].get('why')}; it holds {held} stopped)",
                            resume_script(),
                            Diff("guard", f"stood down: {s['stood_down'].get('why')}\n",
                                 "guarding: restarts counted from now; what it holds starts once memory allows\n"),
                            [facts.fact("guard"), facts.fact("request")], become=True)])
