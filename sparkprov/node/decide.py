"""The guard's decisions, pure: from its state and one sample, the next state, what to do and what
to journal. Every rule follows what Spark owners measured (gb10-field-timelines.md):

- NVRM memory lines are recorded (counted, bursts coalesced), never a stop by themselves: healthy
  starts log them (vllm-project/vllm#56824, #54200).
- Memory is judged on MemFree and free high-order blocks, not MemAvailable: under the floor (or no
  free block of hugeblock_mib) the guard drops the page cache and compacts, rate-limited; only when
  MemFree stays under the critical level after that does it stop serving (or the load).
- A stall is an engine whose counters on /metrics stand still with requests running, /health 200:
  stopped at stall_s, at once (a stalled core answers no SIGTERM). The token probe is the second
  opinion: it runs when the counters have been still, and a token that does not come counts only
  while they stay still.
- Restarts: only once memory came back, at most restart_budget in restart_window_h; then the guard
  stands down until `invoke guard --resume` or a new cluster-up.
"""

from __future__ import annotations

import json
import time

from .readings import GIB, MIB, free_blocks_at_least, order_of
from .supervise import work_done, worked

# A headless rank has no API to say when its load ends: this long after its start it counts as
# loading (the rank supervisor's start bound, supervise.py START_TIMEOUT's default).
HEADLESS_LOAD_S = 900
# Less reclaimable page cache than this (MemAvailable - MemFree) is not worth a drop.
DROP_WORTH = 512 * MIB
# NVRM lines closer than this in time are one burst (one journal event).
NVRM_QUIET_S = 2.0
# One reclaim episode (journaled as its first reclaim and a summary) ends after this long with
# memory over the floor: a load drops caches every few seconds, and says so twice, not each time.
EPISODE_QUIET_S = 30.0
# A reclaim that did not help makes the next wait twice as long, up to this, while serving: compaction
# can fail for good on a long-running node (FujitsuPolycom/sparkring#173: after drop_caches and
# compact_memory, 55 and 11 blocks of 16 MiB against 1,417 after a reboot), and each costs the node CPU.
RECLAIM_BACKOFF_MAX_S = 3600
# A token probe that failed while the engine worked is journaled at most this often per container.
BUSY_NOTE_EVERY_S = 600
# How long a stop may take: a stall or a hung engine is killed at once, anything else stopped gracefully.
STOP_GRACE_S = 20
KILL_GRACE_S = 0


def new_state() -> dict:
    return {"engines": {}, "held": {}, "restarts": [], "stood_down": None, "restart_counts": {},
            "mem_low": 0, "mem_ok": 0, "critical_reclaims": 0, "reclaim_t": None, "reclaim": None, "reclaim_futile": 0,
            "episode": None,
            "nvrm": None, "nvrm_lines": 0}


def serving_containers(containers: list[dict]) -> list[dict]:
    """The node's serving containers (the gateway routes and Prometheus watches: neither holds a model)."""
    return [c for c in containers if (c.get("labels") or {}).get("sparkprov.role") not in ("gateway", "monitor")]


def event(now: float, kind: str, reading, threshold, action: str, **extra) -> dict:
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "epoch": round(now, 3), "kind": kind,
            "reading": reading, "threshold": threshold, "action": action, **extra}


def gib(n: float | None) -> str:
    return f"{n / GIB:.2f} GiB" if n is not None else "?"


def memory_view(sample: dict, cfg: dict) -> dict:
    """What the sample says of memory: MemFree, MemAvailable, free blocks of hugeblock_mib or more
    (None: /proc/buddyinfo unread), and the floors in bytes."""
    mem = sample.get("mem") or {}
    zones = sample.get("buddy")
    order = order_of(int(cfg["hugeblock_mib"]) * MIB, int(sample.get("page_size") or 4096))
    return {"free": mem.get("MemFree"), "avail": mem.get("MemAvailable"), "total": mem.get("MemTotal"),
            "high": free_blocks_at_least(zones, order) if zones else None, "order": order,
            "floor": float(cfg["mem_free_floor_gib"]) * GIB, "critical": float(cfg["mem_critical_gib"]) * GIB}


def describe_memory(m: dict, cfg: dict) -> str:
    high = "" if m["high"] is None else f"; {m['high']} free blocks of {cfg['hugeblock_mib']} MiB or more"
    return f"MemFree {gib(m['free'])} (MemAvailable {gib(m['avail'])}{high})"


def phases(containers: list[dict], engines: dict, now: float) -> dict[str, str]:
    """Each running serving container: "loading" (started, its API not answering yet; a headless rank
    for HEADLESS_LOAD_S after its start) or "serving"."""
    out = {}
    for c in containers:
        if c.get("status") != "running":
            continue
        if c.get("port"):
            out[c["name"]] = "serving" if (engines.get(c["name"]) or {}).get("served") else "loading"
        else:
            started = c.get("started")
            out[c["name"]] = "loading" if started is not None and now - started < HEADLESS_LOAD_S else "serving"
    return out


def host_phase(ph: dict[str, str]) -> str:
    return "loading" if "loading" in ph.values() else "serving" if ph else "idle"


def _track_engines(st: dict, containers: list[dict], sample: dict, cfg: dict, now: float,
                   events: list, breaches: list, actions: list) -> None:
    """The stall rule and the token probe (the second opinion), per container that serves the API."""
    tokens = sample.get("tokens") or {}
    live = set()
    for c in containers:
        name = c["name"]
        if c.get("status") != "running" or not c.get("port"):
            continue
        live.add(name)
        ident = [c.get("id"), c.get("started")]
        e = st["engines"].get(name)
        if not e or e.get("ident") != ident:
            e = st["engines"][name] = {"ident": ident, "served": False, "last": None, "moved_t": now, "strikes": 0,
                                       "token_t": None, "token_base": None, "token_last": None, "busy_noted": None}
        reading = c.get("engine")
        if reading is not None:
            if not e["served"] or e["last"] is None or worked(e["last"], reading):
                e["moved_t"] = now
            # judged only once it generated its first token since it started: the first request after
            # a start may compile kernels for long with the counters still (spark-gotchas G20: FlashInfer
            # autotune, JIT); the start's own bounds (readiness, the supervisor) cover a start that never
            # generates
            e["served"] = e["served"] or reading["generation"] > 0
            e["last"] = reading
        quiet = now - e["moved_t"]
        e["quiet_s"] = round(quiet, 1)
        # the stall: counters still with requests running, /health 200
        if (e["served"] and reading is not None and reading["running"] > 0 and quiet >= float(cfg["stall_s"])
                and c.get("health") == 200):
            breaches.append({"kind": "stall", "grace_s": KILL_GRACE_S,
                             "reading": f"{name}: the engine's counters still for {quiet:.1f}s with "
                                        f"{reading['running']:g} request(s) running ({reading['waiting']:g} waiting), "
                                        f"/health 200 (generation {reading['generation']:g}, prompt "
                                        f"{reading['prompt']:g} tokens, KV cache {100 * reading['kv']:.1f}%)",
                             "threshold": f"stall_s {float(cfg['stall_s']):g}s still with requests running"})
        # the token probe: its result, then whether to send another
        res = tokens.get(name)
        if res is not None:
            e["token_t"], e["token_last"] = None, now
            if res.get("status") == 200 or res.get("status") is not None:
                e["strikes"] = 0     # a token, or an error answered: the supervisor's and the restart policy's case
            elif worked(e["token_base"], e["last"]):
                e["strikes"] = 0
                if e["busy_noted"] is None or now - e["busy_noted"] >= BUSY_NOTE_EVERY_S:
                    e["busy_noted"] = now
                    events.append(event(now, "liveness-busy", f"{name}: no token in {cfg['liveness_timeout_s']:g}s, "
                                        f"but the engine worked meanwhile ({work_done(e['token_base'], e['last'])})",
                                        "a token that does not come counts only while the engine's counters stand "
                                        "still", "none: a busy engine is not a hung one"))
            else:
                e["strikes"] += 1
        if e["strikes"] >= int(cfg["liveness_failures"]):
            breaches.append({"kind": "liveness", "grace_s": KILL_GRACE_S,
                             "reading": f"{name}: /health 200, no token in {cfg['liveness_timeout_s']:g}s "
                                        f"{e['strikes']} times in a row, the engine's counters still for {quiet:.0f}s",
                             "threshold": f"{cfg['liveness_failures']} x {cfg['liveness_timeout_s']:g}s with the "
                                          "counters still"})
        if (e["served"] and reading is not None and e["token_t"] is None and quiet >= float(cfg["liveness_every_s"])
                and (e["token_last"] is None or now - e["token_last"] >= float(cfg["liveness_every_s"]))):
            e["token_t"], e["token_base"] = now, reading
            actions.append({"do": "token", "names": [name]})
    for name in list(st["engines"]):
        if name not in live:
            del st["engines"][name]


def _memory(st: dict, m: dict, phase: str, cfg: dict, now: float, events: list, breaches: list,
            actions: list, running: list[str], sample_error: str | None) -> None:
    """Reclaim (drop the page cache, compact) under the floor or with no free high-order block; stop
    only when MemFree stays under the critical level after a reclaim."""
    free = m["free"]
    low = free is not None and free < m["floor"]
    fragmented = m["high"] == 0
    # the result of the reclaim the daemon made after the last sample
    done, st["reclaim"] = st.get("reclaim"), None
    if done is not None and sample_error:
        done["error"] = sample_error
    ep = st.get("episode")
    if done is not None:
        # a reclaim that freed little and left no free high-order block: the next one waits longer
        gained = (free or 0) - (done.get("free") or 0) >= DROP_WORTH or (m["high"] or 0) > (done.get("high") or 0)
        st["reclaim_futile"] = 0 if gained else st.get("reclaim_futile", 0) + 1
    if done is not None and ep is not None and not ep.get("journaled"):
        ep["journaled"] = True
        after = describe_memory(m, cfg)
        ok = not low and not fragmented
        events.append(event(now, "reclaim", f"{done['before']} while {done['phase']}",
                            f"MemFree floor {float(cfg['mem_free_floor_gib']):g} GiB; a free block of "
                            f"{cfg['hugeblock_mib']} MiB", f"{done['what']}: {after} after"
                            + ("; memory came back, nothing stopped" if ok else
                               f"; still short, nothing stopped while MemFree is over {float(cfg['mem_critical_gib']):g}"
                               " GiB" if free is not None and free >= m["critical"] else "")
                            + (f" ({done['error']})" if done.get("error") else "")))
    if low or fragmented:
        if ep is None:
            ep = st["episode"] = {"since": now, "lowest": free, "reclaims": 0, "journaled": False}
        ep["last_short"] = now
        if free is not None:
            ep["lowest"] = free if ep["lowest"] is None else min(ep["lowest"], free)
    elif ep is not None and now - ep.get("last_short", ep["since"]) >= EPISODE_QUIET_S:
        if ep["reclaims"] > 1:
            events.append(event(now, "reclaim", f"memory over the floor for {EPISODE_QUIET_S:g}s: "
                                f"{describe_memory(m, cfg)}; lowest MemFree {gib(ep['lowest'])} in "
                                f"{ep['last_short'] - ep['since']:.0f}s", f"MemFree floor "
                                f"{float(cfg['mem_free_floor_gib']):g} GiB", f"{ep['reclaims']} cache drops and "
                                "compactions in all; nothing stopped"))
        st["episode"] = ep = None
    critical = free is not None and free < m["critical"]
    st["mem_low"] = st["mem_low"] + 1 if critical else 0
    if not critical:
        st["critical_reclaims"] = 0
    # reclaim, rate-limited: while loading (or critical) often, while serving seldom
    every = float(cfg["reclaim_load_every_s"] if phase == "loading" or critical else cfg["reclaim_serve_every_s"])
    if phase != "loading" and not critical:   # compaction can fail for good (sparkring#173): back off
        every = min(every * 2 ** st.get("reclaim_futile", 0), max(every, RECLAIM_BACKOFF_MAX_S))
    if (low or fragmented) and cfg["act"] and (st["reclaim_t"] is None or now - st["reclaim_t"] >= every):
        drop = low and (m["avail"] or 0) - (free or 0) >= DROP_WORTH
        st["reclaim_t"] = now
        ep["reclaims"] += 1
        st["critical_reclaims"] += 1 if critical else 0
        what = ("dropped the page cache and compacted" if drop else "compacted")
        st["reclaim"] = {"before": describe_memory(m, cfg), "phase": phase, "what": what, "free": free,
                         "high": m["high"]}
        actions.append({"do": "reclaim", "drop": drop, "compact": True})
    samples = int(cfg["mem_samples"])
    if st["mem_low"] >= samples and (st["critical_reclaims"] or not cfg["act"]) and (
            st["mem_low"] == samples or (running and cfg["act"])):
        breaches.append({"kind": "memory", "grace_s": STOP_GRACE_S,
                         "reading": f"{describe_memory(m, cfg)}, {st['mem_low']} samples in a row, after dropping the "
                                    f"page cache and compacting, while {phase}",
                         "threshold": f"MemFree {float(cfg['mem_critical_gib']):g} GiB for {samples} samples"})


def _kernel(st: dict, kernel: list[dict], phase: str, m: dict, cfg: dict, now: float, events: list,
            breaches: list) -> None:
    """NVRM memory lines: counted and journaled once per burst, never a stop. Fatal Xids stop."""
    nvrm = [k for k in kernel if k["kind"] == "nvrm-memory"]
    if nvrm:
        b = st["nvrm"] or {"first": now, "count": 0, "max_per_s": 0, "line": nvrm[0]["line"], "phase": phase,
                           "free": m["free"]}
        per_s: dict[str, int] = {}
        for k in nvrm:   # the kernel's own second when /dev/kmsg gave it, else this sample's
            sec = str(k["at_us"] // 1_000_000) if k.get("at_us") is not None else f"t{int(now)}"
            per_s[sec] = per_s.get(sec, 0) + 1
        b["count"] += len(nvrm)
        b["max_per_s"] = max(b["max_per_s"], *per_s.values())
        b["last"] = now
        st["nvrm"] = b
        st["nvrm_lines"] = st.get("nvrm_lines", 0) + len(nvrm)
    b = st["nvrm"]
    if b is not None and now - b["last"] >= NVRM_QUIET_S:
        events.append(event(now, "nvrm-memory", f"{b['count']} NVRM memory line(s) in {b['last'] - b['first']:.0f}s, at "
                            f"most {b['max_per_s']} in one second, while {b['phase']} (MemFree {gib(b['free'])}): "
                            f"{b['line']}", "recorded only: healthy starts log these lines (vllm-project/vllm#56824: one "
                            "per start that reached KV sizing, 16 in one second at rest; #54200: 75 in one start)",
                            "none", count=b["count"], max_per_s=b["max_per_s"]))
        st["nvrm"] = None
    for k in kernel:
        if k["kind"] == "xid" and k["xid"] in cfg["fatal_xids"]:
            breaches.append({"kind": "xid", "grace_s": STOP_GRACE_S, "reading": k["line"],
                             "threshold": f"Xid in {cfg['fatal_xids']}"})
        elif k["kind"] != "nvrm-memory":
            events.append(event(now, k["kind"], k["line"], "recorded only", "none"))


def memory_back(m: dict, held_gpu: list[dict]) -> str | None:
    """Why memory has not come back for a restart (None: it has): MemFree under the floor, no free
    high-order block, device memory still held by a process of a stopped container."""
    if m["free"] is not None and m["free"] < m["floor"]:
        return f"MemFree {gib(m['free'])} under the floor {gib(m['floor'])}"
    if m["high"] == 0:
        return "no free block of the size a load needs"
    if held_gpu:
        return "device memory still held: " + ", ".join(f"pid {p['pid']} {gib(p.get('used_bytes'))}" for p in held_gpu)
    return None


# Long on purpose: the guard's one pure decision per sample, every trigger in the order it is judged
# (each reads and updates the same state); split, the order and the state would travel between parts.
def decide(state: dict, sample: dict, cfg: dict) -> tuple[dict, list[dict], list[dict]]:
    """From the guard's state and one sample: the next state, the actions ({"do": "stop"|"start"|
    "reclaim"|"token", ...}), and the events to journal. `sample`: t, mem (meminfo bytes), buddy
    (buddyinfo zones), page_size, kernel (classified lines since the last), containers (docker's, each
    with `engine`: its counters or None, `health` when read), tokens (token results since the last),
    gpu_procs (NVML's compute processes with their container, None unknown), resume (asked for)."""
    st = json.loads(json.dumps(state))
    now = sample["t"]
    containers = serving_containers(sample.get("containers") or [])
    running = [c["name"] for c in containers if c.get("status") == "running"]
    by_name = {c["name"]: c for c in containers}
    events: list[dict] = []
    actions: list[dict] = []
    breaches: list[dict] = []
    to_stop: set[str] = set()

    if sample.get("resume"):
        why = st["stood_down"]["why"] if st["stood_down"] else "not stood down"
        events.append(event(now, "resume", f"asked to resume ({why})", "invoke guard --resume",
                            "guarding again: restarts counted from now" + (", the containers it holds started once "
                                                                          "memory allows" if st["held"] else "")))
        st["stood_down"], st["restarts"], st["restart_counts"] = None, [], {}
        for h in st["held"].values():
            h["since"] = min(h["since"], now - float(cfg["restart_after_s"]))

    # containers the guard holds stopped that someone removed or started again: not held any more
    for name in list(st["held"]):
        if name not in by_name or name in running:
            del st["held"][name]
            st["restart_counts"].pop(name, None)   # started by hand: its restarts count from now
    if not st["held"] and st["stood_down"]:
        events.append(event(now, "resume", "the containers it held were started again or removed (cluster-up, "
                            "cluster-down)", "a new cluster-up", "guarding again: restarts counted from now"))
        st["stood_down"], st["restarts"] = None, []

    m = memory_view(sample, cfg)
    ph = phases(containers, st["engines"], now)
    phase = host_phase(ph)
    _track_engines(st, containers, sample, cfg, now, events, breaches, actions)
    _memory(st, m, phase, cfg, now, events, breaches, actions, running, sample.get("reclaim_error"))
    _kernel(st, sample.get("kernel") or [], phase, m, cfg, now, events, breaches)

    # the crash-loop breaker on docker's restart policy: one container restarted too often
    window, limit = float(cfg["breaker_window_s"]), int(cfg["breaker_restarts"])
    for c in containers:
        seen = [p for p in st["restart_counts"].get(c["name"], []) if now - p[0] <= window]
        count = int(c.get("restarts") or 0)
        if not seen or seen[-1][1] != count:   # only the changes (the state file is written every sample)
            seen.append([now, count])
        st["restart_counts"][c["name"]] = seen
        n = seen[-1][1] - seen[0][1]
        if n >= limit and c["name"] in running and cfg["act"]:
            to_stop.add(c["name"])
            st["held"][c["name"]] = {"since": now, "kind": "crash-loop"}
            st["stood_down"] = {"since": now, "why": f"{c['name']} restarted {n} times within {window / 60:g} min"}
            events.append(event(now, "crash-loop", f"{c['name']}: {n} restarts by docker's restart policy",
                                f"{limit} restarts within {window / 60:g} min",
                                f"stopped {c['name']} and stood down: it will not be started again until invoke guard "
                                "--resume (or cluster-up)"))
    for name in list(st["restart_counts"]):
        if name not in by_name:
            del st["restart_counts"][name]

    grace = STOP_GRACE_S
    for b in breaches:
        stop = [n for n in running if n not in to_stop]
        if cfg["act"] and stop:
            to_stop.update(stop)
            grace = min(grace, b["grace_s"])
            for n in stop:
                st["held"][n] = {"since": now, "kind": b["kind"]}
            action = "stopped " + ", ".join(stop)
        else:
            action = "none (act: false)" if stop else "none (nothing serving)"
        events.append(event(now, b["kind"], b["reading"], b["threshold"], action, phase=phase))
        running = [n for n in running if n not in to_stop]
    if to_stop and cfg["act"]:
        actions.append({"do": "stop", "names": sorted(to_stop), "grace_s": grace})
        for n in to_stop:
            st["engines"].pop(n, None)

    # restart what the guard stopped: once memory came back, within the budget
    held = [n for n in st["held"] if n not in to_stop]
    held_ids = {by_name[n].get("id") for n in held if n in by_name}
    held_gpu = [p for p in sample.get("gpu_procs") or [] if p.get("container") in held_ids]
    why_not = memory_back(m, held_gpu)
    st["mem_ok"] = 0 if why_not else st["mem_ok"] + 1
    due = [n for n in held if now - st["held"][n]["since"] >= float(cfg["restart_after_s"])]
    if due and not breaches and not st["stood_down"]:
        if why_not or st["mem_ok"] < int(cfg["mem_clear_samples"]):
            for n in due:
                if why_not and not st["held"][n].get("waiting"):
                    st["held"][n]["waiting"] = True
                    events.append(event(now, "restart-waiting", f"{n}: {why_not}",
                                        "memory back: MemFree over the floor, a free high-order block, no device "
                                        "memory left in a stopped container", "not restarted yet"))
        else:
            budget, span = int(cfg["restart_budget"]), float(cfg["restart_window_h"]) * 3600
            st["restarts"] = [t for t in st["restarts"] if now - t <= span]
            if len(st["restarts"]) >= budget:
                why = f"{len(st['restarts'])} restarts within {float(cfg['restart_window_h']):g} h"
                st["stood_down"] = {"since": now, "why": why}
                events.append(event(now, "stand-down", why, f"restart_budget {budget} in "
                                    f"{float(cfg['restart_window_h']):g} h", "stood down: " + ", ".join(sorted(held))
                                    + " left stopped; fix the cause, then invoke guard --resume (or cluster-up)"))
            else:
                st["restarts"].append(now)
                actions.append({"do": "start", "names": sorted(due)})
                events.append(event(now, "restart", "cause cleared: " + ", ".join(
                    sorted({st["held"][n]["kind"] for n in due})) + f"; {describe_memory(m, cfg)}",
                    f"restart_after_s {float(cfg['restart_after_s']):g}; {len(st['restarts'])} of {budget} restarts "
                    f"in {float(cfg['restart_window_h']):g} h", "started " + ", ".join(sorted(due))))
                for n in due:
                    del st["held"][n]
    st["phase"] = phase
    return st, actions, events
