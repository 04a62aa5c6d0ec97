"""The fan-out of a stage: which way a sender reaches a receiver, and the pipelined send that
runs beside the download on the source.

Pipelined: the source does not wait for the whole download. Each file goes to every host that
needs it as soon as the source has verified it (huggingface_hub's download and the sha256 check,
sparkprov/staging/fetch.py), while the next files download; what the source already held goes
at once. Each (receiver, file) pair is one job, and the receiver hashes and publishes the file
with the same shell the publish play runs (sparkprov/staging/verify.py), so its hashing overlaps
the download too and nothing is left to hash at the end:

- a file the receiver has no byte of goes as the stdin of one SSH channel whose command writes
  it to the staging area, then hashes and publishes it (one channel, no rsync: rsync's own
  processes and checksums cost a quarter of the fan-out's CPU, and the sha256 on arrival is the
  check that counts);
- a file the receiver holds part of (an earlier run cut short) goes by rsync --partial
  --append-verify, which sends only what is missing, then the hash runs on a second channel.
  A channel cut mid-file leaves a partial file, and the next route, or the send play, resumes it
  by rsync.

A receiver's small files (git blobs: config, tokenizer) that it has no byte of go together, on
one channel, once the last of them is on the source (batch_put: each read to its size, then
checked): on a small model the per-file channels, not the bytes, were the fan-out's cost.

At most `streams` jobs run at once (xargs -P); each receiver's jobs share one SSH connection
(ControlMaster), so a file costs a channel, not a handshake. That connection, and each relay hop's
on a ring, is opened while the downloader starts (relay_warm), so no file waits for a handshake.

On a ring (each Spark cabled to two neighbours only) the source sends to its two neighbours, and
each receiver relays: the bytes it receives go through `tee` into its own staging file and, over
the link to the next Spark of the ring, to that Spark's same put, which relays on in turn, so every
Spark receives while the one before it receives, and a ring stages in about one download (issue 34;
eugr/spark-vllm-docker#176: copies on a ring that fell back to the management network). A Spark
that does not need a file still relays it; each hop's check comes back up the chain as a `@hop`
line and is reported for that hop.

What the pipeline delivered (sent and verified on the receiver) is reported on stdout as

    @sent<TAB>RECEIVER<TAB>ITEM<TAB>RSYNC_RC<TAB>VERIFY<TAB>ERROR

(a batch's files as @sentrel lines, naming the file by its path, and the batch's channel as
@batch<TAB>RECEIVER<TAB>RC<TAB>ERROR)

and the send play afterwards sends only what it did not deliver (a cut route, a file held only
by another host), so nothing is sent twice.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import dataclass

from sparkprov.staging.plan import Item, repo_dir
from sparkprov.staging.verify import FUNCS
from sparkprov.transport.shell import quote

# AES-GCM first: the CPU's AES instructions (x86 AES-NI, Arm's crypto extensions on Grace) move
# bytes at about twice ChaCha20's speed, OpenSSH's first choice otherwise. A cut cable sends no FIN:
# the peer's sshd answers a keep-alive from its event loop however busy the disk or rsync is, so four
# unanswered ones 5 s apart mean the link is gone (20 s; rsync's own --timeout stays the bound for a
# receiver that is alive but writes nothing)
SSH_BASE = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5",
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=4", "-o", "Compression=no",
            "-o", "Ciphers=^aes128-gcm@openssh.com,aes256-gcm@openssh.com", "-T", "-x"]
RSYNC = ["rsync", "-a", "--mkpath", "--partial", "--append-verify", "--timeout=60"]


def on_local_link(address: str) -> bool:
    """True when this machine has an interface address in the same subnet as `address`
    (reachable without a gateway)."""
    try:
        target = ipaddress.ip_address(address)
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
        for iface in json.loads(out or "[]"):
            for a in iface.get("addr_info", []):
                net = ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
                if target in net and not net.is_loopback:
                    return True
    except (ValueError, OSError, subprocess.SubprocessError, KeyError):
        return False
    return False


def routes(sender: str, receiver: str, *, fabric: str | None, address: str, local_hosts: list[str],
           ssh_options: list[str]) -> list[tuple[str, list[str]]]:
    """Where `sender` sends to `receiver`, best first, with the ssh argv for each. A Spark sends
    over the receiver's fabric address (provision's SSH mesh); the control machine over the
    inventory address with the inventory's key and known_hosts."""
    if sender not in local_hosts:
        return [(fabric or address, SSH_BASE)]
    opts = SSH_BASE + ssh_options
    out = []
    # only a control machine on the fabric itself sends there; anything else would route a
    # private address through its default gateway
    if fabric and fabric != address and on_local_link(fabric):
        out.append((fabric, opts + ["-o", f"HostKeyAlias={address}"]))
    return out + [(address, opts)]


@dataclass(frozen=True)
class Receiver:
    name: str
    user: str
    store: str                               # absolute, as the receiver resolved it
    routes: list[tuple[str, list[str]]]      # (address, ssh argv), best first
    partial: frozenset[str] = frozenset()    # rels it holds part of: those resume by rsync
    # a ring: the receivers this one relays to, in order, each with the address the one before it
    # reaches it at (their link's); indexes into the pipeline's receivers
    relay: tuple[tuple[int, str], ...] = ()


def relay_put(it: Item, size_check: str, chain: list[tuple[int, Receiver, str, bool]], need: bool,
              funcs: str = FUNCS) -> str:
    """The receiver's side of a one-channel put that relays (see the module docstring), as the shell
    run with the store as $1 after FUNCS: the bytes from stdin into staging (when `need`) and, through
    tee, to the next receiver of `chain` ((index, receiver, its address, whether it needs the item)),
    whose own put relays on; then this one's check, and the next ones' checks as `@hop` lines."""
    f = f'"$S/.sparkprov/staging/"{quote(it.rel)}'
    if not chain:
        return (f'S=$1; f={f}; mkdir -p "$(dirname "$f")" && head -c {int(it.size)} > "$f" && {size_check}\n')
    (idx, nxt, addr, nxt_need), rest = chain[0], chain[1:]
    inner = relay_put(it, size_check, rest, nxt_need, funcs)
    ssh = _hop_ssh(nxt, addr, f"sh -c {quote(funcs + inner)} sh {quote(nxt.store)}")
    keep = f'mkdir -p "$(dirname "$f")" && head -c {int(it.size)} | tee "$H/p" > "$f"' if need else \
        f'head -c {int(it.size)} > "$H/p"'
    return (f'S=$1; f={f}; H=$(mktemp -d); mkfifo "$H/p"; mkdir -p ~/.cache/sparkprov\n'
            f'{ssh} < "$H/p" > "$H/o" 2>"$H/e" & hp=$!\n'
            f'{keep}; kr=$?\nwait $hp; hr=$?\n'
            # the next one's own check, then the hops it reported, each naming its receiver
            f"awk -F '\\t' -v i={idx} -v rc=$hr '$1 == \"R\" {{print \"@hop\\t\" i \"\\t\" rc \"\\t\" $0; next}} "
            f"$1 == \"@hop\" {{print}}' \"$H/o\"\n"
            f'[ -s "$H/o" ] || printf \'@hop\\t%s\\t%s\\tR\\t%s\\tlost\\t\\n\' {idx} "$hr" {quote(it.rel)}\n'
            f'rm -rf "$H"\n'
            + (f'[ $kr = 0 ] && {size_check}\n' if need else f"printf 'R\\t%s\\trelayed\\t\\n' {quote(it.rel)}\n"))


def batch_put(batch: list[tuple[Item, str, bool]], chain: list[tuple[int, Receiver, str, list[bool]]],
              funcs: str = FUNCS) -> str:
    """The receiver's side of one channel carrying several whole files, one after another (the
    small files of a stage: config, tokenizer), as the shell run with the store as $1 after FUNCS:
    `batch` is (item, its check, whether this receiver needs it), in the order the bytes come. Each
    file's bytes are read to its size (`head -c`), kept in staging when needed and checked there in
    the background, and, on a ring, passed through `tee` on one channel to the next receiver of
    `chain` ((index, receiver, its address, which items it needs)), whose own batch put does the
    same; the next ones' checks come back as `@hop` lines. A hop that dies leaves this one reading
    on (`tee -p`): every file here still gets its bytes, in step with the stream."""
    keep = 'mkdir -p "$(dirname "$f")" && head -c {size} | tee -p "$f" >&3'
    body = []
    for it, check, need in batch:
        f = f'f="$S/.sparkprov/staging/"{quote(it.rel)}'
        if not chain:
            body.append(f'{f}; mkdir -p "$(dirname "$f")" && head -c {int(it.size)} > "$f" && {{ {check} & }}'
                        if need else f"head -c {int(it.size)} >/dev/null; printf 'R\t%s\trelayed\t\n' {quote(it.rel)}")
        elif need:
            body.append(f'{f}; {keep.format(size=int(it.size))} && {{ {check} & }}')
        else:
            body.append(f"head -c {int(it.size)} | tee -p /dev/null >&3; printf 'R\t%s\trelayed\t\n' {quote(it.rel)}")
    if not chain:
        return "S=$1\n" + "\n".join(body) + "\nwait\n"
    (idx, nxt, addr, nxt_needs), rest = chain[0], chain[1:]
    inner = batch_put([(it, check, n) for (it, check, _), n in zip(batch, nxt_needs)], rest, funcs)
    ssh = _hop_ssh(nxt, addr, f"sh -c {quote(funcs + inner)} sh {quote(nxt.store)}")
    return ('S=$1; H=$(mktemp -d); mkfifo "$H/p"; mkdir -p ~/.cache/sparkprov\n'
            f'{ssh} < "$H/p" > "$H/o" 2>"$H/e" & hp=$!\n'
            'exec 3>"$H/p"\n' + "\n".join(body) + "\nexec 3>&-\nwait $hp; hr=$?\nwait\n"
            f"awk -F '\\t' -v i={idx} -v rc=$hr '$1 == \"R\" {{print \"@hop\\t\" i \"\\t\" rc \"\\t\" $0; next}} "
            f"$1 == \"@hop\" {{print}}' \"$H/o\"\n"
            # a next hop that said nothing (it could not be reached): its first file is reported lost
            + (f'[ -s "$H/o" ] || printf \'@hop\\t%s\\t%s\\tR\\t%s\\tlost\\t\\n\' {idx} "$hr" '
               f'{quote(next(it.rel for (it, _, _), n in zip(batch, nxt_needs) if n))}\n')
            + 'rm -rf "$H"\n')


def _hop_ssh(nxt: Receiver, addr: str, command: str) -> str:
    """The ssh a relaying receiver runs `command` with on the next one: one connection per hop for
    all the files it relays (the first use makes it; ~ expands in ssh)."""
    return " ".join(quote(w) for w in SSH_BASE + ["-o", "ControlMaster=auto", "-o", "ControlPersist=15", "-o",
                                                  "ControlPath=~/.cache/sparkprov/relay-%C", f"{nxt.user}@{addr}",
                                                  command])


def relay_warm(chain: list[tuple[int, Receiver, str]]) -> str:
    """The shell a relaying receiver runs while the source's download starts: the connection to the
    next receiver of `chain` ((index, receiver, its address)) opened, and through it the next one's,
    so that no file waits for an SSH handshake on any hop (each hop is one more handshake otherwise,
    paid by the first file that crosses it). Never fails: a hop it cannot open is the put's to report."""
    if not chain:
        return "true"
    (_, nxt, addr), rest = chain[0], chain[1:]
    return (f"mkdir -p ~/.cache/sparkprov; {_hop_ssh(nxt, addr, f'sh -c {quote(relay_warm(rest))}')} "
            "</dev/null >/dev/null 2>&1; true")


def _rsync_dest(user: str, address: str, store: str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{user}@{host}:{store}/.sparkprov/staging/"


# One job: `sh SEND DIR "RECEIVER ITEM MODE"` (MODE s: a weight streamed as it downloads; c: the
# whole file on one channel; r: rsync, then the check). Tries each route in turn (255: ssh could not connect or the link dropped: the
# next route, by rsync, which resumes what a cut channel left).
_SEND = r"""T=$1; set -- $2; r=$1; i=$2; m=$3
# a connection per receiver (two stores on one host would share one, and its sessions cap)
CP="-o ControlMaster=auto -o ControlPersist=15 -o ControlPath=$T/c-$r"
case $r in
@ROUTES@
esac
case $i in
@ITEMS@
esac
case "$r.$i" in
@RELAYS@
esac
if [ "$m" = b ]; then
  # the small files on one channel (batch_put), in the order __sp_cat writes them; each one's
  # verdict as @sentrel (by its path), then the channel's own status
  rc=255; out=
  while [ $# -ge 3 ]; do
    mkfifo "$T/b.$r"
    __sp_cat > "$T/b.$r" 2>/dev/null & cp=$!
    out=$(sh -c "$1 $CP \"\$0\" \"\$1\"" "$2" "sh -c $QFUNCS$QPUT sh $QDEST" < "$T/b.$r" 2>"$T/e.$r.b")
    rc=$?
    kill $cp 2>/dev/null; rm -f "$T/b.$r"
    [ $rc = 255 ] || break
    shift 3
  done
  printf '%s\n' "$out" | awk -F '\t' -v r="$r" -v rc="$rc" '
    $1 == "R" {printf "@sentrel\t%s\t%s\t%s\t%s\t\n", r, rc, $2, $3}
    $1 == "@hop" {printf "@sentrel\t%s\t%s\t%s\t%s\trelayed\n", $2, $3, $5, $6}'
  printf '@batch\t%s\t%s\t%s\n' "$r" "$rc" "$(tail -n 1 "$T/e.$r.b" 2>/dev/null | tr '\t' ' ')"
  exit 0
fi
if [ "$m" = w ]; then
  # the connection to this receiver opened (and its relay hops', QWARM) while the download starts
  QWARM=true
  case $r in
@WARMS@
  esac
  sh -c "$1 $CP \"\$0\" \"\$1\"" "$2" "sh -c $QWARM" </dev/null >/dev/null 2>&1
  exit 0
fi
# the one-channel put: SSH_ARGV DEST from FILE (the receiver writes, hashes and publishes it);
# sets rc (ssh's: 255 when the connection failed) and v (the check's verdict)
__sp_put() {
  v=$(sh -c "$1 $CP \"\$0\" \"\$1\"" "$2" "sh -c $QFUNCS$QPUT sh $QDEST" < "$3" 2>"$T/e.$r.$i")
  rc=$?
  # a ring: what the receivers after this one reported (relay_put's @hop lines), as theirs
  printf '%s\n' "$v" | awk -F '\t' -v i="$i" '$1 == "@hop" {printf "@sent\t%s\t%s\t%s\t%s\trelayed\n", $2, i, $3, $6}'
  v=$(printf '%s\n' "$v" | awk -F '\t' '$1 == "R" {print $3; exit}')
  if [ $rc = 0 ]; then [ -n "$v" ] || v=lost; else v=none; fi
}
rc=255; v=none
while [ $# -ge 3 ] && [ "$m" = s ]; do
  # a weight still downloading: its staging file as it grows, until its size is reached (or the
  # download ends: the lifeline dies and tail stops), on one channel; the receiver checks it
  # (the receiver's `head -c SIZE` ends the channel at the file's size; then tail is stopped)
  mkfifo "$T/f.$r.$i"
  tail -c +1 -f -s 0.2 --pid="$(cat "$T/life")" "$SRC/.sparkprov/staging/$REL" > "$T/f.$r.$i" 2>/dev/null &
  tp=$!
  __sp_put "$1" "$2" "$T/f.$r.$i"
  kill $tp 2>/dev/null; rm -f "$T/f.$r.$i"
  [ $rc = 255 ] || break
  shift 3
done
if [ "$m" = s ] && [ "$v" != ok ] && [ "$rc" != 255 ] && [ -f "$SRC/$REL" ]; then
  # the weight was published before its stream could open it (a fast download, a queue of
  # streams), or its stream fell short while the download went on: the whole file, on one
  # channel (not after a lost connection: the send play resumes that one, once)
  exec sh "$0" "$T" "$r $i c"
fi
# a stream cut short: what arrived stays as a partial file, which the send play resumes
while [ $# -ge 3 ] && [ "$m" != s ]; do
  if [ "$m" = c ]; then
    __sp_put "$1" "$2" "$SRC/$REL"
    [ $rc = 255 ] || break
    m=r; shift 3; continue
  fi
  printf '%s\n' "$REL" | rsync -a --mkpath --partial --append-verify --timeout=60 --files-from=- \
    -e "$1 $CP" "$SRC/" "$3" 2>"$T/e.$r.$i"
  rc=$?
  if [ $rc = 0 ]; then
    v=$( { printf 'S=%s\n' "$QDEST"; cat "$T/funcs"; printf '%s\n' "$CHECK"; } \
         | sh -c "$1 $CP \"\$0\" sh -s" "$2" 2>>"$T/e.$r.$i" | awk -F '\t' '$1 == "R" {print $3; exit}')
    [ -n "$v" ] || v=lost
    break
  fi
  [ $rc = 255 ] || break
  shift 3
done
printf '@sent\t%s\t%s\t%s\t%s\t%s\n' "$r" "$i" "$rc" "$v" "$(tail -n 1 "$T/e.$r.$i" 2>/dev/null | tr '\t' ' ')"
exit 0
"""


# Long on purpose: one shell pipeline in its three parts, each line a stage of it, read top to bottom.
def pipeline(source_store: str, receivers: list[Receiver], items: list[Item], wants: dict[str, list[str]],
             streams: int) -> tuple[str, str, str]:
    """Shell for the source's download script, in three parts: (start, the filter that queues
    each file as the downloader reports it, finish). `wants`: receiver -> rels it needs from
    this source. The download script's temporary folder is $T (removed by its trap)."""
    index = {it.rel: n for n, it in enumerate(items)}
    # item -> its jobs: all of them (a file the source holds: sent at once), those that wait for
    # the file to be downloaded and verified, and those that stream it while it downloads
    by_item: dict[int, list[str]] = {}
    after: dict[int, list[str]] = {}
    streamed: dict[int, list[str]] = {}
    relayed = {i for rec in receivers for i, _ in rec.relay}
    # a receiver that relays gets every file one after it needs (it relays what it does not need)
    carries = {rec.name: list(dict.fromkeys(wants.get(rec.name, []) + [rel for i, _ in rec.relay
                                                                         for rel in wants.get(receivers[i].name, [])]))
               for rec in receivers}
    # receiver -> the small files it gets whole: one channel for all of them (batch_put), once the
    # last of them is on the source (downloaded and verified, or held already)
    batches: dict[int, list[int]] = {}
    for r, rec in enumerate(receivers):
        if r in relayed:
            continue  # reached through the receiver before it
        for rel in carries[rec.name]:
            n = index[rel]
            mode = "r" if rel in rec.partial else "c"
            if mode == "c" and not items[n].large:
                batches.setdefault(r, []).append(n)
                continue
            by_item.setdefault(n, []).append(f"{r} {n} {mode}")
            if mode == "c" and items[n].large:
                streamed.setdefault(n, []).append(f"{r} {n} s")
            else:
                after.setdefault(n, []).append(f"{r} {n} {mode}")
    routes_case, items_case = [], []
    for r, rec in enumerate(receivers):
        words = []
        for addr, ssh in rec.routes:
            words += [" ".join(quote(w) for w in ssh), f"{rec.user}@{addr}", _rsync_dest(rec.user, addr, rec.store)]
        # QDEST: the store as the receiver's shell reads it (quoted for that shell)
        routes_case.append(f"{r}) QDEST={quote(quote(rec.store))}; "
                           f"set -- {' '.join(quote(w) for w in words)};;")
    refs = refs_fn(items)
    funcs = FUNCS + refs
    checks: dict[int, str] = {}
    for n in sorted(by_item):
        it = items[n]
        check = checks[n] = _check(it, bool(refs))
        # the receiver's side of the one-channel put (after FUNCS, with the store as $1): the
        # bytes from stdin into staging, then the check that hashes and publishes them
        put = (f'S=$1; f="$S/.sparkprov/staging/"{quote(it.rel)}; mkdir -p "$(dirname "$f")" && '
               f'head -c {int(it.size)} > "$f" && {check}\n')
        items_case.append(f"{n}) REL={quote(it.rel)}; CHECK={quote(check)}; "
                          f"QPUT={quote(quote(put))};;")
    relays_case = []
    for r, ns in batches.items():
        for n in ns:
            checks.setdefault(n, _check(items[n], bool(refs)))
        rec = receivers[r]
        batch = [(items[n], checks[n], items[n].rel in wants.get(rec.name, [])) for n in ns]
        chain = [(i, receivers[i], addr, [items[n].rel in wants.get(receivers[i].name, []) for n in ns])
                 for i, addr in rec.relay]
        while chain and not any(chain[-1][3]):
            chain.pop()  # nobody further on needs any of them
        cat = " ".join('"$SRC"/' + quote(items[n].rel) for n in ns)
        relays_case.append(f"{r}.b) QPUT={quote(quote(batch_put(batch, chain, funcs)))}; __sp_cat() {{ cat {cat}; }};;")
    for r, rec in enumerate(receivers):
        for n in sorted(by_item) if rec.relay else ():
            it = items[n]
            chain = [(i, receivers[i], addr, it.rel in wants.get(receivers[i].name, [])) for i, addr in rec.relay]
            while chain and not chain[-1][3]:
                chain.pop()  # nobody further on needs it
            if chain:
                put = relay_put(it, checks[n], chain, it.rel in wants.get(rec.name, []), funcs)
                relays_case.append(f"{r}.{n}) QPUT={quote(quote(put))};;")
    heads = sorted({int(job.split()[0]) for jobs in by_item.values() for job in jobs} | set(batches))
    warms_case = [f"{r}) QWARM={quote(quote(relay_warm([(i, receivers[i], addr) for i, addr in receivers[r].relay])))};;"
                  for r in heads if receivers[r].relay]
    # two quoted words side by side are one word to the remote shell: sh -c 'FUNCS''PUT' sh 'STORE'
    send = (f"SRC={quote(source_store)}\nQFUNCS={quote(quote(funcs))}\n" + _SEND).replace(
        "@ROUTES@", "\n".join(routes_case)).replace("@ITEMS@", "\n".join(items_case)).replace(
        "@RELAYS@", "\n".join(relays_case)).replace("@WARMS@", "\n".join(warms_case))
    start = "\n".join([
        f'cat > "$T/funcs" <<\'SPARKPROV_VERIFY\'\n{funcs}SPARKPROV_VERIFY',
        f'cat > "$T/send" <<\'SPARKPROV_SEND\'\n{send}SPARKPROV_SEND',
        'mkfifo "$T/q" "$T/qs"',
        # the lifeline: streams follow a growing file until it dies (when the download is over)
        'sleep 2147483647 </dev/null >/dev/null 2>&1 & __sp_life=$!; echo $__sp_life > "$T/life"',
        # each receiver's connection, and its relay hops', opened while the downloader starts
        "__sp_warm=",
        *[f'sh "$T/send" "$T" {quote(f"{r} - w")} </dev/null >/dev/null 2>&1 & __sp_warm="$__sp_warm $!"'
          for r in heads],
        f'xargs -r -d \'\\n\' -n 1 -P {max(1, streams)} sh "$T/send" "$T" < "$T/q" > "$T/sent" 2>&1 &',
        "__sp_xargs=$!",
        # a stream is as fast as the download: one per receiver, beside the `streams` sends
        f'xargs -r -d \'\\n\' -n 1 -P {max(1, min(64, len(receivers)))} sh "$T/send" "$T" < "$T/qs" '
        f'> "$T/streamed" 2>&1 &',
        "__sp_xargs_s=$!",
        'exec 3>"$T/q" 4>"$T/qs"',
        _batch_fn(batches),
        _queue_fn("__sp_queue", 3, by_item, batch=True),      # a file the source holds already
        _queue_fn("__sp_queue_after", 3, after, batch=True),  # SPARKPROV-FETCHED n: downloaded and verified
        _queue_fn("__sp_stream", 4, streamed),    # SPARKPROV-FETCHING n: its download begins
    ]) + "\n"
    feed = ('while IFS= read -r line; do printf \'%s\\n\' "$line"; case "$line" in '
            '"SPARKPROV-FETCHED "*) __sp_queue_after "${line#SPARKPROV-FETCHED }";; '
            '"SPARKPROV-FETCHING "*) __sp_stream "${line#SPARKPROV-FETCHING }";; esac; done')
    finish = "\n".join([
        "exec 3>&- 4>&-",
        'kill "$__sp_life" 2>/dev/null',
        'wait "$__sp_xargs" || true',
        'wait "$__sp_xargs_s" || true',
        'for p in $__sp_warm; do wait "$p" || true; done',
        'cat "$T/sent" "$T/streamed"',
        'for s in "$T"/c-*; do [ -S "$s" ] && ssh -o ControlPath="$s" -O exit sparkprov >/dev/null 2>&1; done; true',
    ]) + "\n"
    return start, feed, finish


def _check(it: Item, refs: bool = False) -> str:
    """The receiver's hash-and-publish of a staged file (verify.FUNCS' __sp_check), then, when the
    stage's refs are the fan-out's to write (refs_fn), __sp_refs."""
    check = " ".join(quote(str(w)) for w in ("__sp_check", "staged", it.rel, it.size, int(it.large), it.digest,
                                             it.link or "", it.link_target or ""))
    return check + (" && __sp_refs" if refs else "")


MAX_REF_LINKS = 64  # a stage with more files leaves its refs to the publish play (the put's shell stays small)


def refs_fn(items: list[Item]) -> str:
    """__sp_refs, run on a receiver after each file it checked: once every snapshot link of the stage
    resolves to a published file (a file is linked only after its hash matched), the refs naming the
    commit are written (tmp + rename), as the publish play would write them, so that play has nothing
    left to change. Whichever file lands last writes them; never before the last. "" when the stage
    has no refs to write, or too many links to list in every put."""
    refs = {f"{repo_dir(i.repo)}/refs/{i.revision}": i.commit for i in items if i.dest is None and i.revision != i.commit}
    links = sorted({i.link for i in items if i.link})
    if not refs or len(links) > MAX_REF_LINKS:
        return ""
    body = [f'for l in {" ".join(quote(x) for x in links)}; do [ -f "$S/$l" ] || return 0; done']
    for ref, commit in sorted(refs.items()):
        body.append(f'mkdir -p "$(dirname "$S"/{quote(ref)})" && printf %s {quote(commit)} > "$S"/{quote(ref)}.sp$$ '
                    f'&& mv -f "$S"/{quote(ref)}.sp$$ "$S"/{quote(ref)}')
    return "__sp_refs() {\n  " + "\n  ".join(body) + "\n  return 0\n}\n"


def _batch_fn(batches: dict[int, list[int]]) -> str:
    """__sp_batch N: file N is on the source; a receiver's batch goes once all of its files are."""
    counts = "; ".join(f"__sp_left_{r}={len(ns)}" for r, ns in sorted(batches.items()))
    per: dict[int, list[int]] = {}
    for r, ns in batches.items():
        for n in ns:
            per.setdefault(n, []).append(r)
    cases = " ".join(f"{n}) " + "; ".join(f"__sp_left_{r}=$((__sp_left_{r} - 1)); if [ \"$__sp_left_{r}\" = 0 ]; "
                                           f"then printf '%s\\n' '{r} b b' >&3; fi" for r in rs) + ";;"
                     for n, rs in sorted(per.items()))
    return (counts + "\n" if counts else "") + f"__sp_batch() {{ case $1 in {cases} esac; }}"


def _queue_fn(name: str, fd: int, jobs: dict[int, list[str]], batch: bool = False) -> str:
    cases = " ".join(f"{n}) printf '%s\\n' {' '.join(quote(j) for j in js)} >&{fd};;" for n, js in sorted(jobs.items()))
    first = '__sp_batch "$1"; ' if batch else ""
    return f"{name}() {{ {first}case $1 in {cases} esac; }}"


def queue_now(rels: list[str], items: list[Item]) -> str:
    """Queue files the source holds already (they need no download)."""
    index = {it.rel: n for n, it in enumerate(items)}
    return "".join(f"__sp_queue {index[r]}\n" for r in rels)


def parse_sent(out: str, receivers: list[Receiver], items: list[Item]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(receiver -> rels delivered and verified there, receiver -> the first reason one was not)."""
    delivered: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    by_rel = {it.rel: n for n, it in enumerate(items)}
    for line in out.splitlines():
        b = line.split("\t")
        if line.startswith("@batch\t") and len(b) >= 3:
            # a batch's channel: its files' verdicts came as @sentrel lines; a failed channel says why
            try:
                rec = receivers[int(b[1])]
            except (ValueError, IndexError):
                continue
            if b[2] != "0" and rec.name not in errors:
                errors[rec.name] = f"the small files to {rec.name}: send exit status {b[2]}" + (
                    f": {b[3]}" if len(b) > 3 and b[3] else "")
            continue
        if line.startswith("@sentrel\t") and len(b) >= 5 and b[3] in by_rel:
            # a batch's file, named by its path: as an @sent line
            b = ["@sent", b[1], str(by_rel[b[3]]), b[2], b[4]] + b[5:]
        elif not line.startswith("@sent\t") or len(b) < 5:
            continue
        try:
            rec, it = receivers[int(b[1])], items[int(b[2])]
        except (ValueError, IndexError):
            continue
        if b[3] == "0" and b[4] == "ok":
            delivered.setdefault(rec.name, []).append(it.rel)
        elif b[4] == "relayed":
            continue  # a receiver that relayed a file it does not need
        elif rec.name not in errors:
            why = f"send exit status {b[3]}" if b[3] != "0" else f"its hash check said {b[4]}"
            errors[rec.name] = f"{it.path} to {rec.name}: {why}" + (f": {b[5]}" if len(b) > 5 and b[5] else "")
    return delivered, errors
