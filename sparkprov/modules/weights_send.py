"""weights_send: this host sends the files other hosts of the stage still lack and it is chosen to
send (the source for what it holds, else the first host holding a file): what the source's
pipelined fan-out (the download play, sparkprov/staging/fanout.py) did not deliver, with rsync into each
receiver's staging area: over the receiver's fabric address from a Spark (provision's SSH mesh),
from the control machine over its inventory address (its key and known_hosts; the fabric only
when this machine sits on that link). --partial --append-verify: a cut link resumes. Every
receiver at once, `streams` rsync processes in all. The receivers' publish play hashes what
arrived; this step only moves bytes.
"""

from __future__ import annotations

from pydantic import Field

from sparkprov.modules.base import Change, FactView, HostContext, Module, Plan
from sparkprov.modules.weights_download import HELD
from sparkprov.modules.weights_store import (DELIVERED, SEND_ERRORS, STAGE, SENT_TO, Args as StoreArgs, items_of,
                                             routes_to, store_fact)
from sparkprov.staging.plan import STAGING, human, split_streams, streams_per_pair
from sparkprov.transport.shell import cmd, quote

class Args(StoreArgs):
    hosts: list[str] = Field(min_length=1)
    streams: int = Field(default=4, ge=1, le=64)
    addresses: dict[str, str] = Field(default_factory=dict)  # host -> inventory address
    ssh_options: dict[str, list[str]] = Field(default_factory=dict)  # host -> ssh options from the control machine


def holders(args, host: HostContext) -> dict[str, list[str]]:
    """rel -> hosts holding it, the source first (with what it holds after its download)."""
    out: dict[str, list[str]] = {}
    for h in [args.source] + [x for x in args.hosts if x != args.source]:
        held = HELD.read(host.exports, h) if h == args.source else None
        if held is None:
            held = STAGE.entry(host.exports, h, "ok")
        for rel in held or []:
            out.setdefault(rel, []).append(h)
    return out


def delivered(args, host: HostContext) -> dict[str, set[str]]:
    """receiver -> files the source's pipelined fan-out already put there (sent and verified)."""
    got = DELIVERED.read(host.exports, args.source) or {}
    return {r: set(rels) for r, rels in got.items()}


class WeightsSend(Module):
    name = "weights_send"
    Args = Args
    doc = "Send the files other hosts lack from this host with rsync (stage-weights fan-out)."

    def needs(self, args: Args, host: HostContext):
        return {"store": store_fact(args, host)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        by_rel = {i.rel: i for i in items_of(args)}
        have = holders(args, host)
        done = delivered(args, host)
        jobs: dict[str, list] = {}
        for r in args.hosts:
            if r == host.name:
                continue
            ex = STAGE.read(host.exports, r)
            if not ex:
                continue  # failed or unreachable in the check play
            for rel in ex.get("need") or []:
                if rel in done.get(r, ()):
                    continue
                # a holder with a way to it (a mesh or ring: a link between the two)
                senders = [h for h in have.get(rel, []) if h != r and routes_to(args, h, r, ex)]
                if senders and senders[0] == host.name:
                    jobs.setdefault(r, []).append(by_rel[rel])
        if not jobs:
            return Plan(msg="nothing to send from here")
        per = streams_per_pair(len(jobs), args.streams)
        src = facts.store.store
        lines = ["set +e", 'L=$(mktemp -d)', "trap 'rm -rf \"$L\"' EXIT",
                 # send FILES (on stdin) to DEST trying each ssh route in turn; a route that fails at
                 # the ssh level (255) passes to the next
                 "__sp_send() { r=$1; n=$2; shift 2; f=\"$L/$r.$n\"; cat > \"$f.list\"; rc=1; "
                 "while [ $# -ge 2 ]; do rsync -a --mkpath --partial --append-verify --timeout=60 "
                 "--files-from=\"$f.list\" -e \"$1\" " + quote(src + "/") + " \"$2\" 2>\"$f.err\"; rc=$?; "
                 "[ $rc = 255 ] || break; shift 2; done; "
                 "printf '@rc\\t%s\\t%s\\t%s\\t%s\\n' \"$r\" \"$n\" \"$rc\" \"$(tail -n 1 \"$f.err\")\"; }"]
        summary = []
        via: dict[str, str] = {}
        for r, items in jobs.items():
            ex = STAGE.read(host.exports, r) or {}
            user = ex.get("user") or "nvidia"
            rts = routes_to(args, host.name, r, ex)
            via[r] = rts[0][0]
            words = []
            for addr, ssh in rts:
                target = f"[{addr}]" if ":" in addr else addr
                words += [" ".join(quote(w) for w in ssh), f"{user}@{target}:{ex.get('store')}/{STAGING}/"]
            for n, group in enumerate(split_streams(items, per)):
                files = "\n".join(i.rel for i in group)
                lines.append(f"__sp_send {quote(r)} {n} {cmd(*words)} <<'SPARKPROV_FILES' &\n{files}\nSPARKPROV_FILES")
            summary.append(f"{len(items)} files ({human(sum(i.size for i in items))}) to {r} over {rts[0][0]}")
        lines.append("wait")

        def outcome(out: str) -> str | None:
            # a receiver that did not get its files fails in its publish play, with this reason
            errors: dict[str, str] = {}
            for line in out.splitlines():
                b = line.split("\t")
                if line.startswith("@rc\t") and len(b) >= 4 and b[3] != "0":
                    errors.setdefault(b[1], f"rsync {host.name} -> {b[1]} ({via.get(b[1], b[1])}) failed "
                                            f"(rc={b[3]}): {b[4] if len(b) > 4 else ''}".rstrip())
            change.exports = SEND_ERRORS(errors)
            return None

        change = Change("send " + "; ".join(summary), "\n".join(lines) + "\n", timeout=7 * 24 * 3600, verify=False,
                        outcome=outcome)
        return Plan([change], exports=SENT_TO(sorted(jobs)))
