"""What the guard reads on a node, parsed: /proc/meminfo, /proc/buddyinfo, kernel log lines,
nvidia-smi's queries, a process's container (its cgroup), and NVML (libnvidia-ml, through ctypes,
where the driver has it). Pure functions except `Nvml`, which loads the library.
"""

from __future__ import annotations

import ctypes
import re

GIB = 2**30
MIB = 2**20


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo in bytes ("MemAvailable:   59063644 kB")."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        words = rest.split()
        if not sep or not words or not words[0].isdigit():
            continue
        out[key.strip()] = int(words[0]) * (1024 if len(words) > 1 and words[1] == "kB" else 1)
    return out


def parse_buddyinfo(text: str) -> list[dict]:
    """/proc/buddyinfo: per zone, the free blocks of each order ("Node 0, zone   Normal   8108  41417 ...":
    order 0 first). [] when unreadable."""
    zones = []
    for line in text.splitlines():
        m = re.match(r"\s*Node\s+(\d+),\s*zone\s+(\S+)\s+([\d\s]+)$", line)
        if m:
            zones.append({"node": int(m.group(1)), "zone": m.group(2), "free": [int(x) for x in m.group(3).split()]})
    return zones


def order_of(size_bytes: int, page_size: int) -> int:
    """The buddy order whose blocks are `size_bytes` (4 MiB with 4 KiB pages: order 10)."""
    order = 0
    while page_size << order < size_bytes:
        order += 1
    return order


def free_blocks_at_least(zones: list[dict], order: int) -> int:
    """Free blocks of `order` or more, over every zone."""
    return sum(sum(z["free"][order:]) for z in zones)


_NVRM_MEMORY = re.compile(r"NV_ERR_NO_MEMORY|_iovaspaceCreateMappingDataFromMemDesc: failed to allocate")
_XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")
_OOM = re.compile(r"Out of memory: Killed process (\d+) \(([^)]*)\)")
_KMSG_PREFIX = re.compile(r"^\d+,\d+,(\d+),[^;]*;")


def classify_kernel_line(line: str) -> dict | None:
    """One kernel log line (a /dev/kmsg record, dmesg or journalctl -k): what the guard reads in it,
    or None. kinds: nvrm-memory, xid (with its code), oom-kill; `at_us`: the kernel's time of a
    /dev/kmsg record (microseconds since boot), None for other forms."""
    line = line.strip()
    rec = _KMSG_PREFIX.match(line)
    msg = line[rec.end():] if rec else line
    at = {"at_us": int(rec.group(1))} if rec else {}
    if _NVRM_MEMORY.search(msg):
        return {"kind": "nvrm-memory", "line": msg[:300], **at}
    m = _XID.search(msg)
    if m:
        return {"kind": "xid", "xid": int(m.group(2)), "device": m.group(1), "line": msg[:300]}
    m = _OOM.search(msg)
    if m:
        return {"kind": "oom-kill", "pid": int(m.group(1)), "process": m.group(2), "line": msg[:300]}
    return None


def _number(cell: str) -> float | None:
    m = re.match(r"\s*(-?[0-9.]+)", cell)
    return float(m.group(1)) if m else None


GPU_QUERY = "temperature.gpu,power.draw,clocks.sm,clocks.max.sm"
GPU_KEYS = ("temperature_c", "power_w", "clock_sm_mhz", "clock_max_sm_mhz")
APPS_QUERY = "pid,used_memory"


def parse_gpu_query(text: str) -> dict[str, float | None]:
    """`nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader` (units or not; GB10 prints [N/A]
    for what it lacks): the first GPU's readings."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= len(GPU_KEYS) and not line.startswith("temperature"):
            return {k: _number(c) for k, c in zip(GPU_KEYS, cells)}
    return dict.fromkeys(GPU_KEYS)


def parse_compute_apps(text: str) -> list[dict]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` (MiB): each
    compute process's device memory in bytes (None where the driver says [N/A])."""
    procs = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= 2 and cells[0].isdigit():
            mib = _number(cells[1])
            procs.append({"pid": int(cells[0]), "used_bytes": int(mib * MIB) if mib is not None else None})
    return procs


_CONTAINER_ID = re.compile(r"(?:docker[-/]|/docker/|containerd[-/])([0-9a-f]{64})")


def container_of(cgroup_text: str) -> str | None:
    """The docker container ID a process runs in, from its /proc/PID/cgroup (cgroup v1 or v2,
    cgroupfs or systemd driver), or None."""
    m = _CONTAINER_ID.search(cgroup_text)
    return m.group(1) if m else None


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t (nvml.h, the _v2/_v3 calls): pid, usedGpuMemory, gpuInstanceId, computeInstanceId
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


NVML_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF   # NVML_VALUE_NOT_AVAILABLE: a figure the driver does not have
_INSUFFICIENT_SIZE = 7


class Nvml:
    """NVML through ctypes, loaded once: each GPU's sensors and each compute process's device memory
    (`usedGpuMemory` of nvmlDeviceGetComputeRunningProcesses: on GB10 it tracks allocations exactly,
    while nvmlDeviceGetMemoryInfo is NotSupported: vllm-project/vllm PR#55828). `Nvml.load()` is
    None where the library is absent or will not initialise."""

    def __init__(self, lib):
        self.lib = lib
        n = ctypes.c_uint()
        self._check(lib.nvmlDeviceGetCount_v2(ctypes.byref(n)))
        self.handles = []
        for i in range(n.value):
            h = ctypes.c_void_p()
            self._check(lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)))
            self.handles.append(h)

    @classmethod
    def load(cls, name: str = "libnvidia-ml.so.1") -> Nvml | None:
        try:
            lib = ctypes.CDLL(name)
            if lib.nvmlInit_v2() != 0:
                return None
            return cls(lib)
        except (OSError, AttributeError, RuntimeError):
            return None

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML error {rc}")

    def _uint(self, fn, *args) -> float | None:
        v = ctypes.c_uint()
        return float(v.value) if fn(*args, ctypes.byref(v)) == 0 else None

    def sensors(self) -> dict[str, float | None]:
        """The first GPU's temperature (C), power (W), SM clock and its maximum (MHz)."""
        if not self.handles:
            return dict.fromkeys(GPU_KEYS)
        h, lib = self.handles[0], self.lib
        mw = self._uint(lib.nvmlDeviceGetPowerUsage, h)
        return {"temperature_c": self._uint(lib.nvmlDeviceGetTemperature, h, 0),   # NVML_TEMPERATURE_GPU
                "power_w": mw / 1000 if mw is not None else None,
                "clock_sm_mhz": self._uint(lib.nvmlDeviceGetClockInfo, h, 1),          # NVML_CLOCK_SM
                "clock_max_sm_mhz": self._uint(lib.nvmlDeviceGetMaxClockInfo, h, 1)}

    def compute_processes(self) -> list[dict]:
        """Every GPU's compute processes: pid and device memory in bytes (None: not available)."""
        out = []
        fn = getattr(self.lib, "nvmlDeviceGetComputeRunningProcesses_v3", None) or \
            self.lib.nvmlDeviceGetComputeRunningProcesses_v2
        for h in self.handles:
            count = ctypes.c_uint(0)
            rc = fn(h, ctypes.byref(count), None)
            if rc == _INSUFFICIENT_SIZE:
                count = ctypes.c_uint(count.value + 8)   # room for processes started meanwhile
                infos = (_ProcessInfo * count.value)()
                rc = fn(h, ctypes.byref(count), infos)
                if rc != 0:
                    continue
                for p in infos[:count.value]:
                    used = None if p.usedGpuMemory == NVML_NOT_AVAILABLE else int(p.usedGpuMemory)
                    out.append({"pid": int(p.pid), "used_bytes": used})
        return out
