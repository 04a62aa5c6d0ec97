"""Every setting of the node guard, declared once as plain data: (name, type, min, max, default,
source). Each is the inventory variable `guard_<name>` (a `guard:` module argument wins over it);
the node reads the same table (guard.py load_config), and sparkprov's inventory checking reads it
from here (modules/guard.py). Types: "float", "int", "bool", "str" (a word: a command name),
"path" (an absolute path), "list[int]", "list[str]"; min and max bound a number (None: unbounded).
"""

from __future__ import annotations

GIB = 2**30

SETTINGS: tuple[tuple[str, str, float | None, float | None, object, str], ...] = (
    ("interval_s", "float", 0.5, 60, 1.0,
     "a stalled engine must be stopped within about 5 s: userspace froze ~5 s after the engine's prompt throughput "
     "fell to 0 with a request Running (NVIDIA/open-gpu-kernel-modules#1358); memory fell 29 -> 2.5 GiB in 9 s "
     "(vllm-project/vllm#54200). Every sample reads files and one small /metrics answer per engine (no process)"),
    ("docker_every_s", "float", 1, 300, 5.0,
     "the containers and their restart counts change only when something starts or stops them; read over "
     "docker's socket (no process)"),
    ("gpu_every_s", "float", 1, 3600, 10.0,
     "temperature, power, clocks and each process's device memory: for /metrics and the restart gate (NVML in "
     "this process where libnvidia-ml is present, else one nvidia-smi)"),
    ("mem_free_floor_gib", "float", 0.25, 64, 8.0,
     "tonyd2wild/GLM-5.3-Flash-NVFP4-DFlash2-2x-DGX-Spark PR#19: dropping caches and compacting whenever MemFree "
     "fell under 8 GiB, from launch to `Application startup complete`, got a TP 2 pair through every load "
     "(MemFree never under 2.6 GiB). MemFree, not MemAvailable: MemAvailable read 22.5 GiB with the pool at "
     "119.2 of 121.7 GiB (vllm#54200); torch.cuda.mem_get_info reports MemFree on GB10 (vllm#48140)"),
    ("mem_critical_gib", "float", 0.1, 32, 2.0,
     "under it after a cache drop and compaction, serving (or the load) stops: the field guard kept MemFree over "
     "2.6 GiB in every healthy load (PR#19); nodes that wedged had 0.14-0.89 GiB free in zone Normal "
     "(MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#23), a Spark near exhaustion 0.97 GiB (gb10-failure-outputs.md 3.3)"),
    ("mem_samples", "int", 1, 100, 3,
     "samples in a row under mem_critical_gib, a reclaim tried, before stopping: one low reading is a moment"),
    ("mem_clear_samples", "int", 1, 100, 3,
     "samples in a row with memory back (MemFree over the floor, a free high-order block, no device memory "
     "left in a stopped container) before a restart: no restart into the same pressure"),
    ("reclaim_load_every_s", "float", 1, 600, 5.0,
     "while a deployment loads, at most one cache drop and compaction this often: the collapse of vllm#54200 "
     "took 9 s"),
    ("reclaim_serve_every_s", "float", 5, 86400, 60.0,
     "while serving, at most one this often: the page cache regrows while serving (defilantech/LLMKube#1857), "
     "and a drop costs the node CPU"),
    ("hugeblock_mib", "int", 1, 1024, 4,
     "free blocks of this size or more (/proc/buddyinfo; 4 MiB is order 10 with 4 KiB pages): nodes that wedged "
     "during loads had none, a fresh boot 24 (MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#23); none left makes "
     "the guard compact, and a restart waits for one"),
    ("stall_s", "float", 1, 600, 3.0,
     "an engine whose token counters on /metrics (generation, prompt; the KV-cache use and request gauges "
     "its scheduler sets every step) stand still this long with requests Running is stalled: userspace froze "
     "~5 s after a stall began (open-gpu-kernel-modules#1358), and the guard must see it (interval_s) and stop "
     "it before that. The longest healthy stillness measured in the lab is in docs/guard.md"),
    ("liveness_every_s", "float", 1, 3600, 10.0,
     "the token probe (the second opinion) runs when the engine's counters have not moved this long: "
     "an idle engine must still generate (vllm#31588: /health 200 while completions hang)"),
    ("liveness_timeout_s", "float", 1, 600, 10.0,
     "seconds for its one token"),
    ("liveness_failures", "int", 1, 100, 2,
     "tokens in a row not generated, with the engine's counters still, before stopping; a token that does not "
     "come while the counters move is a busy engine (a bench at concurrency 64 missed 10 s twice, issue 32)"),
    ("restart_after_s", "float", 0, 86400, 20.0,
     "seconds after a stop before the guard starts the containers again (memory permitting)"),
    ("restart_budget", "int", 0, 100, 3,
     "at most this many restarts by the guard within restart_window_h, then it stands down until `invoke guard "
     "--resume` or a new cluster-up: eugr/spark-vllm-docker examples/glm-watchdog.sh (3 per 6 h); 35 restart "
     "cycles leaked unified memory until sshd stopped answering (eugr/spark-vllm-docker#257)"),
    ("restart_window_h", "float", 0.01, 168, 6.0,
     "the window of restart_budget (glm-watchdog.sh: 6 h)"),
    ("breaker_restarts", "int", 1, 1000, 10,
     "one container restarted this often by docker's policy within breaker_window_s: the guard stops it and "
     "stands down (#257 looped about 35 times; one recovery of a multi-node group costs a rank one or two)"),
    ("breaker_window_s", "float", 60, 604800, 1800.0,
     "the window of breaker_restarts"),
    ("fatal_xids", "list[int]", 0, 1000, [48, 79, 119, 120, 154],
     "Xids that mean the GPU needs a reset (NVIDIA's Xid catalog; 119/120/154 before a GB10's reboot, "
     "gb10-failure-outputs.md 1.3): serving stops. Other Xids are recorded"),
    ("port", "int", 1, 65535, 9410,
     "/metrics, on loopback and on the fabric interfaces' addresses"),
    ("fabric_ifaces", "list[str]", None, None, ["enp1s0f0np0", "enp1s0f1np1", "enP2p1s0f0np0", "enP2p1s0f1np1"],
     "a Spark's ConnectX-7 interfaces (gb10-outputs.md)"),
    ("act", "bool", None, None, True,
     "false: journal what it would do, stop and drop nothing (a dry run on a node)"),
    ("meminfo", "path", None, None, "/proc/meminfo", "the kernel's memory figures (MemFree, MemAvailable)"),
    ("buddyinfo", "path", None, None, "/proc/buddyinfo", "the kernel's free blocks per order and zone"),
    ("kernel_log", "path", None, None, "/dev/kmsg", "the kernel's log, read from its end (NVRM, Xid, OOM kills)"),
    ("docker_socket", "path", None, None, "/var/run/docker.sock",
     "docker's API: the containers read with no docker process per sample"),
    ("nvidia_smi", "str", None, None, "nvidia-smi",
     "where NVML cannot be loaded: GB10's driver ships both (NVML's nvmlDeviceGetMemoryInfo is NotSupported on "
     "GB10, its per-process usedGpuMemory is not: vllm-project/vllm PR#55828)"),
)

NAMES = tuple(s[0] for s in SETTINGS)
DEFAULTS: dict[str, object] = {s[0]: s[4] for s in SETTINGS}
SOURCES: dict[str, str] = {s[0]: s[5] for s in SETTINGS}


def check(name: str, value: object) -> object:
    """`value` for setting `name`, as its type (an int given for a float is a float); raises
    ValueError saying what is allowed."""
    row = next((s for s in SETTINGS if s[0] == name), None)
    if row is None:
        raise ValueError(f"no such setting (one of {', '.join(NAMES)})")
    _, kind, lo, hi, _, _ = row
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false (got {value!r})")
        return value
    if kind == "path":
        if not isinstance(value, str) or not value.startswith("/") or "\n" in value:
            raise ValueError(f"must be an absolute path (got {value!r})")
        return value
    if kind.startswith("list["):
        item = kind[5:-1]
        if not isinstance(value, list):
            raise ValueError(f"must be a list of {item} (got {value!r})")
        return [_one(item, v, lo, hi) for v in value]
    return _one(kind, value, lo, hi)


def _one(kind: str, value: object, lo: float | None, hi: float | None) -> object:
    if kind == "str":
        if not isinstance(value, str) or not value or "\n" in value:
            raise ValueError(f"must be a name (got {value!r})")
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (kind == "int" and not float(value).is_integer()):
        raise ValueError(f"must be {'a whole number' if kind == 'int' else 'a number'} (got {value!r})")
    v = int(value) if kind == "int" else float(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"must be between {lo:g} and {hi:g} (got {value!r})")
    return v


def resolve(given: dict[str, object]) -> dict[str, object]:
    """Every setting: `given`'s value (None: not given) checked, else the default. Raises
    ValueError("NAME: why") at the first bad one."""
    out = {}
    for name in NAMES:
        value = given.get(name)
        try:
            out[name] = DEFAULTS[name] if value is None else check(name, value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return out
