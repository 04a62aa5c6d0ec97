"""Memory planner for vLLM on a 128 GB unified-memory Spark (pure functions, no I/O).

How vLLM spends memory (what the notes show, 001 §8 "Memory & KV cache"):

    budget   = --gpu-memory-utilization x total memory CUDA sees       (one instance)
    kv_pool  = budget - weights - runtime overhead (activations, CUDA graphs, torch)
    tokens   = kv_pool / kv_bytes_per_token                             (a capacity, G17)
    full-length concurrency = tokens / --max-model-len

Numbers used (each a default a caller can change):

* total memory CUDA sees on a 128 GB Spark: 119.6 GiB. 002: "At 0.55 we get ~65.8 GB reserved"
  (65.8 / 0.55 = 119.6) and "119 GB total". 128 GB (decimal) is 119.2 GiB; the OS reports ~119.6.
* runtime overhead: 3.2 GiB. 001's log: util 0.85, "Model loading took 21.94 GiB",
  "Available KV cache memory: 76.49 GiB" -> 0.85 x 119.6 - 21.94 - 76.49 = 3.23 GiB.

KV bytes per token (from the model config):

    2 (K and V) x attention layers x KV heads x head dim x dtype bytes     (per node: / TP)

Only layers that keep a per-token KV cache count. In hybrid models (Qwen3.5/3.6/Qwen3-Next:
Gated-DeltaNet linear attention with a full-attention layer every 4th; Nemotron-3: Mamba-2 with
6 GQA layers, 001 §7.3.1) the linear/Mamba layers hold a fixed-size state per sequence, not per
token, so they are left out of the formula. That makes the formula a lower bound for hybrids:
vLLM carves the Mamba state out of the same pool, and with prefix caching on it switches to
"align" mode (G11) and reports fewer tokens. The notes' own logs show it: Qwen3.6-35B-A3B
costs ~16.6 KiB/token at fp8 (001 §8; the formula gives 10 KiB), Qwen3.5-35B-A3B-FP8 ~62 GiB /
~820K tokens = ~79 KiB/token (000). Where a note gives a measured figure, the catalog records it
and the planner prefers it (a recipe's `kv_measured`).

Sliding-window layers (gpt-oss, Gemma) hold at most a window of tokens; like the linear layers they
are left out (the catalog lists only the full-attention layer count).

How far these figures are from every measured one they were not fitted to, and why:
docs/memory-planner.md (tests/unit/test_planner_measured.py keeps it true).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1024**3
HOST_MEMORY_GIB = 119.6  # 002 "0.55 -> ~65.8 GB reserved"; "119 GB total"
NOMINAL_HOST_GB = 128.0  # the marketing figure (decimal GB), 001 §2
RUNTIME_OVERHEAD_GIB = 3.2  # derived from 001 §8's startup log (see module docstring)
MIN_HEADROOM_GIB = 4.0  # sparkprov default: what the OS, sshd, docker and page cache keep at least

KV_DTYPE_BYTES = {
    "auto": 2, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
    "float32": 4, "fp32": 4,
}


class PlanError(ValueError):
    """The numbers cannot work; the message says what to change."""


def gb_to_gib(gb: float) -> float:
    return gb * 1e9 / GIB


def kv_dtype_bytes(kv_dtype: str | None) -> int:
    """Bytes per element of the KV cache. vLLM's default (`auto`) keeps the model dtype (BF16)."""
    key = (kv_dtype or "auto").lower()
    if key not in KV_DTYPE_BYTES:
        raise PlanError(f"unknown KV cache dtype {kv_dtype!r}; known: {', '.join(sorted(KV_DTYPE_BYTES))}")
    return KV_DTYPE_BYTES[key]


def kv_bytes_per_token(attention_layers: int, kv_heads: int, head_dim: int, kv_dtype: str | None = "auto",
                       tp: int = 1) -> int:
    """KV cache bytes one token costs on ONE node: 2 x layers x KV heads x head dim x dtype bytes / TP.

    `attention_layers` counts only the layers that keep per-token KV (full attention); see the
    module docstring for hybrid and sliding-window models. With tensor parallelism each rank keeps
    kv_heads / tp heads (at least one head each when kv_heads < tp: vLLM replicates them).
    """
    if min(attention_layers, kv_heads, head_dim, tp) <= 0:
        raise PlanError("layers, KV heads, head dim and TP must all be positive")
    heads_per_rank = max(1, math.ceil(kv_heads / tp))
    return 2 * attention_layers * heads_per_rank * head_dim * kv_dtype_bytes(kv_dtype)


def pool_tokens(kv_pool_gib: float, bytes_per_token: float) -> int:
    """Tokens the KV pool holds: a capacity shared by all running requests, not a context window."""
    if bytes_per_token <= 0:
        raise PlanError("KV bytes per token must be positive")
    return max(0, int(kv_pool_gib * GIB // bytes_per_token))


def concurrency(tokens: int, max_model_len: int) -> float:
    """How many full-length (--max-model-len) requests fit in the pool at once (001 §8)."""
    if max_model_len <= 0:
        raise PlanError("--max-model-len must be positive")
    return tokens / max_model_len


def budget_gib(gpu_memory_utilization: float, host_gib: float = HOST_MEMORY_GIB) -> float:
    if not 0 < gpu_memory_utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    return gpu_memory_utilization * host_gib


@dataclass(frozen=True)
class ModelPlan:
    """One vLLM instance on one host."""

    name: str
    gpu_memory_utilization: float
    max_model_len: int | None
    max_num_seqs: int | None
    budget_gib: float
    weights_gib: float | None
    overhead_gib: float
    kv_pool_gib: float | None
    bytes_per_token: float | None
    pool_tokens: int | None
    concurrency: float | None

    @property
    def fits_one_sequence(self) -> bool | None:
        if self.pool_tokens is None or self.max_model_len is None:
            return None
        return self.pool_tokens >= self.max_model_len

    def summary(self) -> str:
        parts = [f"{self.name}: util {self.gpu_memory_utilization:.2f} = {self.budget_gib:.1f} GiB"]
        if self.weights_gib is not None:
            parts.append(f"weights {self.weights_gib:.1f} GiB")
        if self.kv_pool_gib is not None:
            parts.append(f"KV pool {self.kv_pool_gib:.2f} GiB")
        if self.pool_tokens is not None:
            parts.append(f"{self.pool_tokens:,} tokens")
        if self.concurrency is not None and self.max_model_len:
            parts.append(f"{self.concurrency:.2f}x at {self.max_model_len:,}")
        return ", ".join(parts)


def plan_model(name: str, *, gpu_memory_utilization: float, weights_gib: float | None = None,
               bytes_per_token: float | None = None, max_model_len: int | None = None,
               max_num_seqs: int | None = None, host_gib: float = HOST_MEMORY_GIB,
               overhead_gib: float = RUNTIME_OVERHEAD_GIB, kv_pool_gib: float | None = None) -> ModelPlan:
    """Plan one instance. `kv_pool_gib` may be given directly (e.g. read from vLLM's log); else it
    is budget - weights - overhead when the weight size is known."""
    budget = budget_gib(gpu_memory_utilization, host_gib)
    if kv_pool_gib is None and weights_gib is not None:
        kv_pool_gib = budget - weights_gib - overhead_gib
    tokens = None
    conc = None
    if kv_pool_gib is not None and bytes_per_token:
        tokens = pool_tokens(max(kv_pool_gib, 0.0), bytes_per_token)
        if max_model_len:
            conc = concurrency(tokens, max_model_len)
    return ModelPlan(name=name, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                     max_num_seqs=max_num_seqs, budget_gib=budget, weights_gib=weights_gib,
                     overhead_gib=overhead_gib, kv_pool_gib=kv_pool_gib, bytes_per_token=bytes_per_token,
                     pool_tokens=tokens, concurrency=conc)


@dataclass(frozen=True)
class Problem:
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message} (fix: {self.fix})"


@dataclass(frozen=True)
class HostPlan:
    host: str
    host_gib: float
    models: tuple[ModelPlan, ...]
    other_services_gib: float
    min_headroom_gib: float
    utilization_sum: float
    headroom_gib: float
    problems: tuple[Problem, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        names = " + ".join(f"{m.name} {m.gpu_memory_utilization:.2f}" for m in self.models)
        return (f"{self.host}: {names} = {self.utilization_sum:.2f} of {self.host_gib:.1f} GiB"
                f" + {self.other_services_gib:.1f} GiB other services -> headroom {self.headroom_gib:.1f} GiB")


def plan_host(models: list[ModelPlan], *, host: str = "host", other_services_gib: float = 0.0,
              host_gib: float = HOST_MEMORY_GIB, min_headroom_gib: float = MIN_HEADROOM_GIB) -> HostPlan:
    """Everything placed on one host (G13). Each instance reserves its whole utilization budget up
    front (001 §8: vLLM pre-allocates the pool), so the budgets add up, plus other services
    (Ollama, ASR, ...; G14). Problems say what to change."""
    total_util = sum(m.gpu_memory_utilization for m in models)
    reserved = sum(m.budget_gib for m in models) + other_services_gib
    headroom = host_gib - reserved
    problems: list[Problem] = []
    for m in models:
        if m.weights_gib is not None and m.kv_pool_gib is not None and m.kv_pool_gib <= 0:
            need = (m.weights_gib + m.overhead_gib + 1.0) / host_gib
            problems.append(Problem(
                f"{m.name}: weights {m.weights_gib:.1f} GiB + overhead {m.overhead_gib:.1f} GiB do not fit its "
                f"budget of {m.budget_gib:.1f} GiB (util {m.gpu_memory_utilization:.2f}): no room for a KV cache",
                f"raise --gpu-memory-utilization to at least {math.ceil(need * 100) / 100:.2f}, use a smaller "
                "checkpoint, or split it over more Sparks (TP)"))
    if headroom < min_headroom_gib:
        deficit = min_headroom_gib - headroom
        fix = ""
        # lower the instance that can give the memory back and still hold its weights plus some KV
        for m in sorted(models, key=lambda m: -m.gpu_memory_utilization):
            target = math.floor((m.gpu_memory_utilization - deficit / host_gib) * 100) / 100
            floor_gib = (m.weights_gib or 0.0) + m.overhead_gib + 1.0
            if target > 0 and target * host_gib >= floor_gib:
                fix = f"lower --gpu-memory-utilization of {m.name} from {m.gpu_memory_utilization:.2f} to {target:.2f}"
                break
        if models and not fix:
            fix = f"move {min(models, key=lambda m: m.gpu_memory_utilization).name} to another host"
        if fix:
            if len(models) > 1:
                fix += " or place fewer models on this host"
        if other_services_gib:
            fix += f" (other services take {other_services_gib:.1f} GiB)"
        problems.append(Problem(
            f"utilizations on {host} sum to {total_util:.2f} ({reserved:.1f} of {host_gib:.1f} GiB with other "
            f"services), leaving {headroom:.1f} GiB; at least {min_headroom_gib:.1f} GiB must stay free for the OS "
            "and page cache", fix))
    return HostPlan(host=host, host_gib=host_gib, models=tuple(models), other_services_gib=other_services_gib,
                    min_headroom_gib=min_headroom_gib, utilization_sum=total_util, headroom_gib=headroom,
                    problems=tuple(problems))


def freed_vs(gpu_memory_utilization: float, baseline: float = 0.85, host_gb: float = NOMINAL_HOST_GB) -> float:
    """GB freed by lowering utilization from `baseline` (001 §8's table uses the nominal 128 GB)."""
    return (baseline - gpu_memory_utilization) * host_gb
