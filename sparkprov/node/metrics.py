"""What the guard serves at /metrics (Prometheus text format), from its state document and its event
counts per kind (pure)."""

from __future__ import annotations


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(doc: dict, counts: dict[str, int]) -> str:
    s = doc.get("sample") or {}
    mem, gpu = s.get("mem") or {}, s.get("gpu") or {}
    guard = doc.get("guard") or {}
    lines: list[str] = []
    described: set[str] = set()

    def gauge(name: str, help_: str, value, labels: dict | None = None, kind: str = "gauge") -> None:
        if value is None:
            return
        if name not in described:
            described.add(name)
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lab = "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in (labels or {}).items()) + "}" if labels else ""
        v = float(value)   # full precision: a timestamp or a byte count must not lose digits to %g
        lines.append(f"{name}{lab} {int(v) if v.is_integer() else repr(v)}")

    gauge("sparkprov_guard_up", "1 while the guard samples", 1)
    gauge("sparkprov_guard_last_sample_timestamp_seconds", "time of the last sample", s.get("t"))
    gauge("sparkprov_guard_mem_free_bytes", "MemFree (/proc/meminfo): on GB10 what the GPU can allocate",
          mem.get("MemFree"))
    gauge("sparkprov_guard_mem_available_bytes", "MemAvailable (/proc/meminfo)", mem.get("MemAvailable"))
    gauge("sparkprov_guard_mem_total_bytes", "MemTotal (/proc/meminfo)", mem.get("MemTotal"))
    gauge("sparkprov_guard_mem_floor_bytes", "the MemFree floor under which the guard drops caches and compacts",
          doc.get("mem_floor_bytes"))
    gauge("sparkprov_guard_mem_critical_bytes", "the MemFree level under which, after that, serving stops",
          doc.get("mem_critical_bytes"))
    gauge("sparkprov_guard_free_hugeblocks", "free blocks of the guard's hugeblock_mib or more (/proc/buddyinfo)",
          s.get("hugeblocks"))
    gauge("sparkprov_guard_swap_total_bytes", "SwapTotal", mem.get("SwapTotal"))
    if mem.get("SwapTotal") is not None:
        gauge("sparkprov_guard_swap_used_bytes", "SwapTotal - SwapFree", mem["SwapTotal"] - mem.get("SwapFree", 0))
    gauge("sparkprov_guard_gpu_temperature_celsius", "GPU temperature", gpu.get("temperature_c"))
    gauge("sparkprov_guard_gpu_power_watts", "GPU power draw", gpu.get("power_w"))
    gauge("sparkprov_guard_gpu_clock_sm_mhz", "GPU SM clock", gpu.get("clock_sm_mhz"))
    gauge("sparkprov_guard_gpu_clock_max_sm_mhz", "GPU SM clock maximum", gpu.get("clock_max_sm_mhz"))
    for p in s.get("gpu_procs") or []:
        gauge("sparkprov_guard_gpu_process_memory_bytes", "a compute process's device memory (NVML usedGpuMemory)",
              p.get("used_bytes"), {"pid": p.get("pid"), "container": p.get("container_name") or ""})
    engines = guard.get("engines") or {}
    for name, e in sorted(engines.items()):
        last = e.get("last") or {}
        gauge("sparkprov_guard_engine_quiet_seconds", "seconds since the engine's counters last moved",
              e.get("quiet_s"), {"container": name})
        gauge("sparkprov_guard_engine_requests_running", "vllm:num_requests_running as the guard last read it",
              last.get("running"), {"container": name})
    for c in s.get("containers") or []:
        live = c.get("liveness")
        if live is not None:
            gauge("sparkprov_guard_liveness_ok", "1 when the container generated the guard's last token",
                  1 if live.get("status") == 200 else 0, {"container": c["name"]})
            gauge("sparkprov_guard_liveness_seconds", "seconds to the token", live.get("seconds"), {"container": c["name"]})
    for r in s.get("rails") or []:
        gauge("sparkprov_rail_gbps", "the rail's throughput at its last qualification (ib_write_bw, Gb/s)", r.get("gbps"),
              {"iface": r["iface"], "peer": r.get("peer") or ""})
        gauge("sparkprov_rail_floor_gbps", "the floor the rail was qualified against (Gb/s)", r.get("floor_gbps"),
              {"iface": r["iface"]})
        gauge("sparkprov_rail_ok", "0 when the rail's last qualification found it degraded", 0 if r.get("status") ==
              "degraded" else 1, {"iface": r["iface"]})
    gauge("sparkprov_guard_held_containers", "containers the guard holds stopped", len(doc.get("held") or {}))
    gauge("sparkprov_guard_stood_down", "1 when the guard stood down (restart budget spent or a crash loop): no "
          "restarts until invoke guard --resume or cluster-up", 1 if doc.get("stood_down") else 0)
    gauge("sparkprov_guard_restarts_in_window", "the guard's restarts within its restart_window_h",
          len(guard.get("restarts") or []))
    gauge("sparkprov_guard_nvrm_lines_total", "NVRM memory lines read in the kernel log since the guard started",
          guard.get("nvrm_lines") or 0, kind="counter")
    for kind, n in sorted(counts.items()):
        gauge("sparkprov_guard_events_total", "events journaled, by kind", n, {"kind": kind}, kind="counter")
    return "\n".join(lines) + "\n"
