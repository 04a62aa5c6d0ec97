"""The node guard's decisions (sparkprov/node/decide.py) on the timelines Spark owners measured
(/work/shared/reference/gb10-field-timelines.md; each test names its source), replayed as samples one
second apart: what it stops, what it only records, and what it says. The guard's own code decides;
only the samples are literal."""

from __future__ import annotations

import pytest

from sparkprov.node import decide as d
from sparkprov.node.readings import classify_kernel_line, parse_buddyinfo
from sparkprov.node.settings import DEFAULTS

GIB = 2**30
CFG = dict(DEFAULTS)
TOTAL = int(121.69 * GIB)   # a Spark's MemTotal (MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks#47: 121.69 GiB)
# The line healthy starts logged, verbatim (vllm-project/vllm#56824, NVIDIA/open-gpu-kernel-modules#1358)
NVRM = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from "
        "_memdescAllocInternal(pMemDesc) @ mem_desc.c:1359")
# /proc/buddyinfo of this lab machine (x86_64, 4 KiB pages), captured 2026-11-28: 878 free blocks of order 10
BUDDY_FRESH = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32      1      1      4      2      5      4      3      3      4      2    752
Node 0, zone   Normal   4561   4616  20001  17139   8506   9464   7623   4041   1868    847    878
"""
# The head node of MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#23 (2026-09-17): zone Normal 138 MB free, no
# free block of 1 MiB or more (order 8+) and none of 4 MiB (order 10+); the table's counts, laid out as
# buddyinfo lays them (orders 0-7 split so that they add up to 138 MB of 4 KiB pages)
BUDDY_WEDGED = "Node 0, zone   Normal  11234   5120   2048    800    200     40      8      1      0      0      0\n"


def mem(free_gib: float, avail_gib: float | None = None) -> dict:
    avail = free_gib if avail_gib is None else avail_gib
    return {"MemTotal": TOTAL, "MemFree": int(free_gib * GIB), "MemAvailable": int(avail * GIB),
            "SwapTotal": 0, "SwapFree": 0}


def rank0(status="running", *, engine=None, health=None, restarts=0, name="sparkprov-nat-rank0", cid="c0", started=1.0):
    return {"name": name, "id": cid, "status": status, "restarts": restarts, "started": started, "port": 8000,
            "engine": engine, "health": health, "labels": {"sparkprov.role": "server", "sparkprov.port": "8000"}}


def rank1(status="running", started=1.0):
    return {"name": "sparkprov-nat-rank1", "id": "c1", "status": status, "restarts": 0, "started": started,
            "port": None, "labels": {"sparkprov.role": "rank"}}


def engine(gen=0.0, prompt=0.0, running=0.0, waiting=0.0, kv=0.0) -> dict:
    return {"generation": gen, "prompt": prompt, "running": running, "waiting": waiting, "kv": kv}


def sample(t, *, m=None, containers=None, kernel=(), buddy=BUDDY_FRESH, tokens=None, gpu_procs=None, resume=False):
    return {"t": t, "mem": m or mem(60), "buddy": parse_buddyinfo(buddy) if buddy else None, "page_size": 4096,
            "kernel": list(kernel), "containers": containers if containers is not None else [rank0(engine=engine())],
            "tokens": tokens or {}, "gpu_procs": gpu_procs, "resume": resume}


def run(samples, cfg=CFG, state=None):
    state = state or d.new_state()
    out = []
    for s in samples:
        state, actions, events = d.decide(state, s, cfg)
        out.append((actions, events))
    return state, out


class Node:
    """What docker shows after the guard's actions: a container it stopped is exited at the next
    sample, one it started runs again (a new start time). Not the guard: its surroundings."""

    def __init__(self, *containers: dict):
        self.containers = {c["name"]: dict(c) for c in containers}

    def apply(self, actions: list[dict], t: float) -> None:
        for a in actions:
            for name in a.get("names", []) if a["do"] in ("stop", "start") else []:
                c = self.containers[name]
                c.update(status="exited", engine=None, health=None) if a["do"] == "stop" else \
                    c.update(status="running", started=t)

    def now(self, **changes) -> list[dict]:
        """The containers; `changes` per running container with a port (its engine, health)."""
        return [{**c, **(changes if c["status"] == "running" and c.get("port") else {})}
                for c in self.containers.values()]


def drive(node: Node, ticks, make, cfg=CFG, state=None):
    """Sample, decide, act on `node`, for each t in `ticks`; make(t, node) -> sample."""
    state = state or d.new_state()
    out = []
    for t in ticks:
        state, actions, events = d.decide(state, make(t, node), cfg)
        node.apply(actions, t)
        out.append((actions, events))
    return state, out


def stops(out) -> list[tuple[int, list[str]]]:
    return [(i, a["names"]) for i, (actions, _) in enumerate(out) for a in actions if a["do"] == "stop"]


def kinds(out) -> list[str]:
    return [e["kind"] for _, events in out for e in events]


def kmsg(line: str, usec: int, seq: int = 1) -> dict:
    return classify_kernel_line(f"3,{seq},{usec},-;{line}")


# -- NVRM lines: recorded, never a stop ------------------------------------------------------------

def test_an_nvrm_burst_at_rest_is_recorded_once_with_its_count_and_stops_nothing():
    """vllm#56824: one host logged 16 NV_ERR_NO_MEMORY lines in one second at rest, serving."""
    burst = [kmsg(NVRM, 81033_000_000 + 50_000 * i, i) for i in range(16)]
    serving = [rank0(engine=engine(gen=100, prompt=50))]
    state, out = run([sample(10, containers=serving)] + [sample(11, containers=serving, kernel=burst)]
                     + [sample(12 + i, containers=serving) for i in range(4)])
    assert stops(out) == [] and all(a["do"] != "stop" for actions, _ in out for a in actions)
    (e,) = [e for _, events in out for e in events]
    assert e["kind"] == "nvrm-memory" and e["count"] == 16 and e["max_per_s"] == 16 and e["action"] == "none"
    assert e["reading"].startswith("16 NVRM memory line(s) in 0s, at most 16 in one second, while serving")
    assert "vllm-project/vllm#56824" in e["threshold"] and state["nvrm_lines"] == 16


def test_75_nvrm_lines_through_a_start_stop_nothing_and_say_it_was_loading():
    """vllm#54200: 75 lines within one engine start that went on; #56824: one per start at KV sizing."""
    loading = [rank0(engine=None)]        # its API does not answer yet: loading
    samples = [sample(t, containers=loading, kernel=[kmsg(NVRM, t * 1_000_000 + k, k) for k in range(5)])
               for t in range(100, 115)]   # 15 s, 5 lines a second
    samples += [sample(115 + i, containers=[rank0(engine=engine())]) for i in range(3)]
    _, out = run(samples)
    assert stops(out) == []
    (e,) = [e for _, events in out for e in events if e["kind"] == "nvrm-memory"]
    assert e["count"] == 75 and e["max_per_s"] == 5 and "while loading" in e["reading"]


def test_a_fatal_xid_still_stops_and_others_are_recorded():
    x119 = classify_kernel_line("NVRM: Xid (PCI:000f:01:00): 119, pid=3849, name=KMS thread, Timeout after 45s")
    x13 = classify_kernel_line("NVRM: Xid (PCI:000f:01:00): 13, Graphics SM Warp Exception")
    _, out = run([sample(1, kernel=[x13]), sample(2, kernel=[x119])])
    assert stops(out) == [(1, ["sparkprov-nat-rank0"])]
    assert kinds(out) == ["xid", "xid"] and out[0][1][0]["action"] == "none"


# -- memory: MemFree and high-order blocks, reclaim first -------------------------------------------

# vllm#54200: during a start the pool collapsed from 29 to 2.5 GiB in 9 s while MemAvailable read 22.5
# GiB (Cached 19.8 GiB): the physical figure, MemFree, one sample a second
COLLAPSE = [29.0, 26.0, 23.0, 20.0, 16.5, 13.0, 10.0, 7.0, 4.5, 2.5]


def test_a_page_cache_flood_during_a_load_is_reclaimed_and_nothing_stops():
    """tonyd2wild PR#19: drop caches and compact whenever MemFree falls under 8 GiB until startup
    completes. The replay: MemFree falls 3 GiB a second as #54200's did (29 -> 2.5 GiB in 9 s) while
    MemAvailable stays at 22.5 GiB (it is page cache); a drop gives the cache back."""
    loading = [rank0(engine=None), rank1()]
    free, lowest, state, out = 29.0, 29.0, d.new_state(), []
    for t in range(200, 260):
        state, actions, events = d.decide(state, sample(t, m=mem(free, 22.5), containers=loading), CFG)
        out.append((actions, events))
        lowest = min(lowest, free)
        dropped = any(a["do"] == "reclaim" and a["drop"] for a in actions)
        free = 22.0 if dropped else max(free - 3.0, 0.5)
    reclaims = [i for i, (actions, _) in enumerate(out) for a in actions if a["do"] == "reclaim"]
    assert reclaims[0] == 8 and out[8][0] == [{"do": "reclaim", "drop": True, "compact": True}]   # 5.0 GiB
    assert all(b - a >= 5 for a, b in zip(reclaims, reclaims[1:]))      # reclaim_load_every_s
    assert stops(out) == [] and lowest >= 2.6                          # PR#19: never under 2.6 GiB
    (e,) = [e for _, events in out for e in events]                    # the first reclaim, then quiet
    assert e["kind"] == "reclaim" and e["reading"].startswith("MemFree 5.00 GiB (MemAvailable 22.50 GiB")
    assert "while loading" in e["reading"] and e["action"].startswith("dropped the page cache and compacted: MemFree "
                                                                        "22.00 GiB")
    assert "memory came back, nothing stopped" in e["action"]
    # startup completes (its API answers): memory stays over the floor, one summary of the episode
    state, out = run([sample(t, m=mem(20.0, 22.5), containers=[rank0(engine=engine()), rank1()])
                      for t in range(260, 300)], state=state)
    (e,) = [e for _, events in out for e in events]
    assert e["action"] == f"{len(reclaims)} cache drops and compactions in all; nothing stopped"


def test_memory_that_stays_under_the_critical_level_after_a_reclaim_stops_the_load():
    """The reclaim fails (nothing to drop, MemAvailable as low as MemFree: a Spark near exhaustion,
    0.97 GiB free, gb10-failure-outputs.md §3.3): after mem_samples samples it stops the load."""
    node = Node(rank0(engine=None), rank1())
    state, out = drive(node, range(300, 306), lambda t, n: sample(t, m=mem(0.97, 2.3), containers=n.now()))
    assert out[0][0] == [{"do": "reclaim", "drop": True, "compact": True}]
    assert stops(out) == [(2, ["sparkprov-nat-rank0", "sparkprov-nat-rank1"])]
    (e,) = [e for e in out[2][1] if e["kind"] == "memory"]
    assert "3 samples in a row, after dropping the page cache and compacting, while loading" in e["reading"]
    assert e["threshold"] == "MemFree 2 GiB for 3 samples" and e["phase"] == "loading"
    assert state["held"]["sparkprov-nat-rank0"]["kind"] == "memory"


def test_memavailable_alone_never_stops():
    """MemAvailable under the old 5% floor, MemFree over the floor: nothing to do."""
    _, out = run([sample(i, m=mem(9.0, 5.0)) for i in range(10)])
    assert out == [([], [])] * 10


def test_no_free_high_order_block_is_compacted_not_dropped_and_stops_nothing():
    """MiaAI-Lab #23: a serving node with no free block of 4 MiB or more (MemFree high): compaction,
    and no stop; a futile compaction waits twice as long before the next (sparkring#173)."""
    serving = [rank0(engine=engine(gen=5))]
    state, out = run([sample(i, m=mem(40, 60), buddy=BUDDY_WEDGED, containers=serving) for i in range(0, 400)])
    compactions = [i for i, (actions, _) in enumerate(out) for a in actions if a["do"] == "reclaim"]
    assert out[0][0] == [{"do": "reclaim", "drop": False, "compact": True}]
    assert compactions == [0, 120, 360]   # reclaim_serve_every_s 60, doubled after each that did not help
    assert stops(out) == [] and kinds(out) == ["reclaim"]
    assert out[1][1][0]["action"].startswith("compacted: MemFree 40.00 GiB (MemAvailable 60.00 GiB; 0 free blocks")


# -- the stall: counters still with requests running -----------------------------------------------

def busy(t: int, running=8.0) -> dict:
    """An engine that steps every second (open-gpu-kernel-modules#1358's ~70k-token prefills: the
    prompt counter moves when a prefill ends, the KV-cache use at every chunk)."""
    return engine(gen=20.0 * t, prompt=700.0 * (t // 5), running=running, kv=0.04 + 0.001 * t)


def test_a_stall_is_stopped_at_stall_s_on_that_host_and_at_once():
    """#1358: prompt throughput fell to 0 with a request Running; userspace froze ~5 s later. The
    counters stop at t=10 (the SIGSTOP of the lab's replay); /health stays 200."""
    frozen = busy(10)
    samples = [sample(t, containers=[rank0(engine=busy(t))]) for t in range(0, 11)]
    samples += [sample(t, containers=[rank0(engine=frozen, health=200)]) for t in range(11, 16)]
    state, out = run(samples)
    assert stops(out) == [(13, ["sparkprov-nat-rank0"])]          # 3 s still: stall_s
    stop = next(a for a in out[13][0] if a["do"] == "stop")
    assert stop["grace_s"] == 0                                     # a stalled core answers no SIGTERM
    (e,) = [e for e in out[13][1] if e["kind"] == "stall"]
    assert e["reading"].startswith("sparkprov-nat-rank0: the engine's counters still for 3.0s with 8 request(s) running")
    assert e["action"] == "stopped sparkprov-nat-rank0" and e["threshold"] == "stall_s 3s still with requests running"


def test_a_first_request_after_a_start_that_compiles_for_long_is_no_stall_and_the_next_stall_is():
    """spark-gotchas G20: the first request after a start triggers JIT (FlashInfer autotune), the
    counters still with it running: not judged until the engine generated its first token since it
    started. Once it has, a stall is one (the lab's restart storm stalls a restarted engine after its
    first second of work)."""
    compiling = engine(gen=0.0, prompt=0.0, running=1.0, kv=0.0)
    samples = [sample(t, containers=[rank0(engine=compiling, health=200)]) for t in range(0, 60)]
    assert stops(run(samples)[1]) == []
    first = engine(gen=1.0, prompt=12.0, running=1.0, kv=0.01)
    samples += [sample(t, containers=[rank0(engine=first, health=200)]) for t in range(60, 66)]
    assert stops(run(samples)[1]) == [(63, ["sparkprov-nat-rank0"])]


def test_counters_that_move_never_stall_and_an_idle_engine_is_no_stall():
    moving = [sample(t, containers=[rank0(engine=busy(t), health=200)]) for t in range(0, 120)]
    _, out = run(moving)
    assert stops(out) == [] and kinds(out) == []
    idle = [sample(t, containers=[rank0(engine=engine(gen=50), health=200)]) for t in range(0, 8)]
    _, out = run(idle)
    assert stops(out) == []


def test_an_engine_whose_health_fails_is_not_a_stall():
    """/health 503 (EngineDeadError): the restart policy's and the supervisor's case."""
    samples = [sample(t, containers=[rank0(engine=busy(min(t, 5)), health=503)]) for t in range(0, 20)]
    assert stops(run(samples)[1]) == []


def test_a_long_prefill_step_moves_the_kv_gauge_and_is_no_stall():
    """One 70k-token prefill alone (#1358's load): no token counted until it ends, the KV cache grows
    with each chunk; steps 2 s apart."""
    samples = [sample(t, containers=[rank0(engine=engine(gen=0, prompt=0, running=1, kv=0.01 * (t // 2)),
                                           health=200)]) for t in range(0, 40)]
    assert stops(run(samples)[1]) == []


# -- the token probe: the second opinion -----------------------------------------------------------

def test_the_token_probe_runs_only_after_the_counters_were_still():
    _, out = run([sample(t, containers=[rank0(engine=busy(t))]) for t in range(0, 60)])
    assert not [a for actions, _ in out for a in actions if a["do"] == "token"]
    ok = {"sparkprov-nat-rank0": {"status": 200, "seconds": 0.1, "error": None}}
    _, out = run([sample(t, containers=[rank0(engine=engine(gen=7))], tokens=ok if t in (11, 22) else None)
                  for t in range(0, 25)])
    sent = [i for i, (actions, _) in enumerate(out) for a in actions if a["do"] == "token"]
    assert sent == [10, 21]   # an idle engine: liveness_every_s after it went still, then after each token


def test_a_busy_engine_whose_token_does_not_come_is_never_stopped():
    """issue 32: at concurrency 64 the probe missed its 10 s twice and the old guard stopped rank 0
    mid-bench. Here each token fails while the counters move: never a strike, one note."""
    state = d.new_state()
    out = []
    for t in range(0, 300):
        e = busy(t, running=64) if t >= 11 else engine(gen=3)   # idle first: the probe is sent
        tokens = {"sparkprov-nat-rank0": {"status": None, "seconds": 10.0, "error": "timed out"}} \
            if state["engines"].get("sparkprov-nat-rank0", {}).get("token_t") is not None and t % 10 == 0 else {}
        state, actions, events = d.decide(state, sample(t, containers=[rank0(engine=e, health=200)], tokens=tokens), CFG)
        out.append((actions, events))
    assert stops(out) == [] and kinds(out) == ["liveness-busy"]
    (e,) = [e for _, events in out for e in events]
    assert e["action"] == "none: a busy engine is not a hung one" and "+" in e["reading"]


def test_a_hung_idle_engine_is_stopped_after_two_tokens_with_the_counters_still():
    """vllm#31588: /health and /metrics 200 while completions hang; idle, so no request runs."""
    state, out = d.new_state(), []
    for t in range(0, 60):
        pending = state["engines"].get("sparkprov-nat-rank0", {}).get("token_t")
        tokens = {"sparkprov-nat-rank0": {"status": None, "seconds": 10.0, "error": "timed out"}} \
            if pending is not None and t - pending >= 10 else {}
        state, actions, events = d.decide(state, sample(t, containers=[rank0(engine=engine(gen=9), health=200)],
                                                        tokens=tokens), CFG)
        out.append((actions, events))
    (i, names), = stops(out)
    assert names == ["sparkprov-nat-rank0"] and i == 40
    (e,) = [e for e in out[i][1] if e["kind"] == "liveness"]
    assert "2 times in a row, the engine's counters still" in e["reading"]


# -- restarts: memory back, a budget, standing down --------------------------------------------------

def stall_cycle(node: Node, state, t0: int, cfg=CFG):
    """A stall at t0+2 (the counters freeze with requests running), the guard's stop, then its
    decisions for a minute (a restart, or not): (state, out, next t)."""
    def make(t, n):
        e = busy(min(t, t0 + 2))
        return sample(t, containers=n.now(engine=e, health=200))
    return (*drive(node, range(t0, t0 + 60), make, cfg, state), t0 + 60)


def test_restarts_wait_for_memory_then_stop_at_the_budget_and_stand_down():
    """eugr/spark-vllm-docker glm-watchdog.sh: at most 3 restarts per 6 h, then stand down (35
    restart cycles leaked memory until sshd died, #257)."""
    node, state, t, all_out = Node(rank0()), d.new_state(), 1000, []
    for _ in range(4):
        state, out, t = stall_cycle(node, state, t)
        all_out += out
    starts = [a for actions, _ in all_out for a in actions if a["do"] == "start"]
    assert len(stops(all_out)) == 4 and len(starts) == 3
    (e,) = [e for _, events in all_out for e in events if e["kind"] == "stand-down"]
    assert e["reading"] == "3 restarts within 6 h" and e["threshold"] == "restart_budget 3 in 6 h"
    assert "invoke guard --resume" in e["action"] and state["stood_down"]["why"] == "3 restarts within 6 h"
    assert state["held"]["sparkprov-nat-rank0"]["kind"] == "stall"
    # it stays down: nothing starts however long memory is back
    state, out = drive(node, range(t, t + 100), lambda t, n: sample(t, containers=n.now()), state=state)
    assert not [a for actions, _ in out for a in actions if a["do"] == "start"]
    # invoke guard --resume: journaled, the held container started once memory allows
    state, out = drive(node, range(t + 100, t + 105), lambda t_, n: sample(t_, containers=n.now(), resume=t_ == t + 100),
                       state=state)
    assert kinds(out)[0] == "resume" and state["stood_down"] is None
    assert [a for actions, _ in out for a in actions if a["do"] == "start"] == [
        {"do": "start", "names": ["sparkprov-nat-rank0"]}]


def test_a_new_cluster_up_ends_the_stand_down():
    state = {**d.new_state(), "stood_down": {"since": 1, "why": "3 restarts within 6 h"}, "restarts": [1, 2, 3],
             "held": {"sparkprov-nat-rank0": {"since": 1, "kind": "stall"}}}
    state, out = run([sample(10, containers=[rank0(engine=engine(), cid="new")])], state=state)
    assert state["stood_down"] is None and state["held"] == {} and state["restarts"] == []
    assert kinds(out) == ["resume"] and "cluster-up" in out[0][1][0]["threshold"]


def test_no_restart_while_memory_has_not_come_back():
    """MemFree under the floor, or device memory still held in the stopped container (NVML's
    usedGpuMemory, vllm PR#55828): the guard waits, says why once, and restarts when it is back."""
    held = {**d.new_state(), "held": {"sparkprov-nat-rank0": {"since": 0, "kind": "stall"}}}
    stopped = [rank0("exited", cid="c9")]
    leak = [{"pid": 4242, "used_bytes": 30 * GIB, "container": "c9"}]
    state, out = run([sample(t, containers=stopped, gpu_procs=leak) for t in range(100, 130)], state=held)
    assert not [a for actions, _ in out for a in actions if a["do"] == "start"]
    (e,) = [e for _, events in out for e in events]
    assert e["kind"] == "restart-waiting" and e["reading"] == ("sparkprov-nat-rank0: device memory still held: "
                                                               "pid 4242 30.00 GiB")
    state, out = run([sample(t, m=mem(5.0), containers=stopped) for t in range(130, 140)], state=state)
    assert not [a for actions, _ in out for a in actions if a["do"] == "start"]
    state, out = run([sample(t, containers=stopped) for t in range(140, 145)], state=state)
    starts = [(i, a) for i, (actions, _) in enumerate(out) for a in actions if a["do"] == "start"]
    assert starts == [(2, {"do": "start", "names": ["sparkprov-nat-rank0"]})]   # mem_clear_samples 3


def test_a_crash_loop_under_dockers_policy_stands_down():
    cfg = {**CFG, "breaker_restarts": 5, "breaker_window_s": 900}
    state, out = run([sample(60 * i, containers=[rank0(engine=engine(), restarts=i)]) for i in range(6)], cfg)
    assert stops(out) == [(5, ["sparkprov-nat-rank0"])] and kinds(out) == ["crash-loop"]
    assert state["stood_down"]["why"] == "sparkprov-nat-rank0 restarted 5 times within 15 min"


def test_the_gateway_is_never_stopped_and_act_false_only_records():
    gw = {**rank0(name="sparkprov-gateway", engine=engine()), "labels": {"sparkprov.role": "gateway"}}
    x = classify_kernel_line("NVRM: Xid (PCI:000f:01:00): 79, GPU has fallen off the bus.")
    _, out = run([sample(0, kernel=[x], containers=[gw, rank0(engine=engine())])])
    assert stops(out) == [(0, ["sparkprov-nat-rank0"])]
    state, out = run([sample(i, m=mem(0.9, 1.0), containers=[rank0(engine=None)]) for i in range(6)],
                     {**CFG, "act": False})
    assert out[0][0] == [] and stops(out) == [] and state["held"] == {}
    assert [e["action"] for _, events in out for e in events] == ["none (act: false)"]


@pytest.mark.parametrize("free,expected", [(COLLAPSE[i], i >= 7) for i in range(len(COLLAPSE))])
def test_the_floor_is_memfree_not_memavailable(free, expected):
    _, out = run([sample(0, m=mem(free, 22.5), containers=[rank0(engine=None)])])
    assert bool(out[0][0]) == expected
