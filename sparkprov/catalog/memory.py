"""Memory planner for vLLM on a 128 GB unified-memory Spark (pure functions, no I/O).

How vLLM spends memory (what the notes show, 001 §8 "Memory & KV cache"):

    budget   = --gpu-memory-utilization x total memory CUDA sees       (one instance)
    kv_pool  = budget - weights - runtime overhead (activations, CUDA graphs, torch)
    tokens   = the pool in vLLM's blocks, per the layers' kinds (below)   (a capacity, G17)
    full-length concurrency = tokens / --max-model-len

Numbers used (each a default a caller can change):

* total memory CUDA sees on a 128 GB Spark: 119.6 GiB. 002: "At 0.55 we get ~65.8 GB reserved"
  (65.8 / 0.55 = 119.6) and "119 GB total". 128 GB (decimal) is 119.2 GiB; the OS reports ~119.6.
* runtime overhead: 3.2 GiB. 001's log: util 0.85, "Model loading took 21.94 GiB",
  "Available KV cache memory: 76.49 GiB" -> 0.85 x 119.6 - 21.94 - 76.49 = 3.23 GiB.

KV cache per token, from each layer's kind (the model's config.json; `kv_capacity`):

* full attention: 2 (K and V) x KV heads x head dim x dtype bytes per layer and token (MLA: one
  latent vector); per node / TP (heads replicate when KV heads < TP).
* sliding window: the same per token, but a sequence keeps at most the window (plus the tokens in
  flight) of it.
* linear attention (Gated DeltaNet) and Mamba-2: a fixed state per sequence (a conv state of
  kernel-1 positions, plus one per speculative token, and the recurrent state), not per token.

vLLM lays these out in one block pool (v1 hybrid KV cache manager, vllm/v1/core/kv_cache_utils.py
and kv_cache_interface.py, read from vllm-project/vllm): every layer's page holds the same bytes,
so the attention block grows until its page covers one state (`block_size` 2096 for
Qwen3.5-35B-A3B at fp8, 2128 with two speculative tokens: the numbers 000 and 002 logged), the
layers are grouped (`group_size` layers of one kind per group), a block is one page of every layer
of a group, and a request takes cdiv(len, block_size) blocks of each attention group, a bounded
number of each sliding group, and 1 (2 with prefix caching's "align" mode) + one per speculative
token of each state group. vLLM reports the pool as `concurrency x --max-model-len` tokens, with
concurrency = blocks / blocks per full-length request. So a hybrid's tokens per GiB depend on
--max-model-len, the speculative tokens and prefix caching, and its linear layers cost a page per
block like an attention layer: the attention-only formula was 40-87% low for them.

How far these figures are from every measured one they were not fitted to, and why:
docs/memory-planner.md (tests/unit/test_planner_measured.py keeps it true).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkprov.catalog.models import ModelConfig

from sparkprov.inventory_vars import default

GIB = 1024**3
HOST_MEMORY_GIB = default("host_memory_gib")  # 119.6: 002 "0.55 -> ~65.8 GB reserved"; "119 GB total"
NOMINAL_HOST_GB = 128.0  # the marketing figure (decimal GB), 001 §2
RUNTIME_OVERHEAD_GIB = 3.2  # derived from 001 §8's startup log (see module docstring)
MIN_HEADROOM_GIB = default("min_headroom_gib")  # 4.0: what the OS, sshd, docker and page cache keep at least

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

    The K and V of full-attention layers only: what a whole model's cache holds per token is
    `kv_capacity`'s (sliding windows and per-sequence states, in vLLM's blocks). With tensor
    parallelism each rank keeps
    kv_heads / tp heads (at least one head each when kv_heads < tp: vLLM replicates them).
    """
    if min(attention_layers, kv_heads, head_dim, tp) <= 0:
        raise PlanError("layers, KV heads, head dim and TP must all be positive")
    heads_per_rank = max(1, math.ceil(kv_heads / tp))
    return 2 * attention_layers * heads_per_rank * head_dim * kv_dtype_bytes(kv_dtype)


# vLLM's KV block: 16 tokens (CacheConfig.DEFAULT_BLOCK_SIZE); a hybrid's attention block is a
# multiple of it (the kernels' alignment) large enough for one state page.
VLLM_BLOCK_SIZE = 16
# `vllm serve` schedules at most this many tokens per step unless --max-num-batched-tokens says
# otherwise (chunked prefill); a sliding window keeps window - 1 + these tokens of a sequence.
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
# vLLM's grouping (kv_cache_utils._get_kv_cache_groups_uniform_page_size): the group size is the
# fewest layers of one kind, or the most when that is under 1.5 times the fewest.
GROUP_SIZE_SLACK = 1.5


@dataclass(frozen=True)
class AttentionLayers:
    """Layers that keep K and V per token: full attention, or a sliding window of `window` tokens."""

    layers: int
    kv_heads: int
    head_dim: int
    window: int | None = None

    def bytes_per_token(self, kv_dtype: str | None, tp: int = 1) -> int:
        """One layer's K and V for one token on one of `tp` ranks."""
        return kv_bytes_per_token(1, self.kv_heads, self.head_dim, kv_dtype, tp)


@dataclass(frozen=True)
class StateLayers:
    """Layers that keep a fixed state per sequence, whatever its length: Gated DeltaNet linear
    attention and Mamba-2. The conv state holds kernel - 1 positions (plus one per speculative
    token) of `conv_channels`; the recurrent state `ssm_elements` values of `ssm_bytes` each."""

    layers: int
    conv_channels: int
    conv_kernel: int
    ssm_elements: int
    ssm_bytes: int
    conv_bytes: int = 2  # the model dtype (BF16)

    def bytes_per_sequence(self, tp: int = 1, spec_tokens: int = 0) -> int:
        """One layer's state for one sequence on one of `tp` ranks (heads and channels split)."""
        conv = math.ceil(self.conv_channels / tp) * (self.conv_kernel - 1 + spec_tokens) * self.conv_bytes
        return conv + math.ceil(self.ssm_elements / tp) * self.ssm_bytes


@dataclass(frozen=True)
class KvShape:
    """A model's layers by the kind of cache they keep (from its config.json)."""

    attention: tuple[AttentionLayers, ...]
    state: tuple[StateLayers, ...] = ()


@dataclass(frozen=True)
class KvCapacity:
    """What vLLM's block pool holds on one node (kv_cache_utils: get_kv_cache_capacity)."""

    tokens: int  # vLLM's "GPU KV cache size": concurrency x --max-model-len
    concurrency: float  # full-length requests the pool holds at once
    block_size: int  # tokens per block of a full-attention group
    page_bytes: int  # one layer's page, the same for every layer
    group_size: int  # layers per group: a block is one page of each
    blocks: int  # blocks in the pool
    blocks_per_request: int  # blocks one full-length request takes, all groups together

    @property
    def bytes_per_request(self) -> int:
        return self.blocks_per_request * self.page_bytes * self.group_size

    def bytes_per_token(self, max_model_len: int) -> float:
        """What a token of a full-length request costs, its share of the state included."""
        return self.bytes_per_request / max_model_len


@dataclass(frozen=True)
class KvSettings:
    """What of a launch sizes its KV cache, besides the pool and the layers."""

    kv_dtype: str | None = "auto"
    max_model_len: int | None = None
    spec_tokens: int = 0
    mtp: bool = False  # the checkpoint's own MTP head speculates: its attention layers keep KV too
    prefix_caching: bool = False
    max_num_batched_tokens: int | None = None

    def capacity(self, shape: KvShape, kv_pool_gib: float, *, tp: int = 1, pp: int = 1) -> KvCapacity:
        if not self.max_model_len:
            raise PlanError("--max-model-len is not known: the capacity vLLM reports depends on it")
        return kv_capacity(shape, kv_pool_gib, max_model_len=self.max_model_len, kv_dtype=self.kv_dtype, tp=tp,
                           pp=pp, spec_tokens=self.spec_tokens, prefix_caching=self.prefix_caching,
                           max_num_batched_tokens=self.max_num_batched_tokens)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_shape_of(config: ModelConfig, *, hybrid: bool, mtp: bool = False) -> KvShape | None:
    """The layers of a catalog config by cache kind; None where the config does not say enough
    (no KV heads or head dim, or a `hybrid` (its traits list state layers) whose state dimensions
    are not recorded: an attention-only figure would overstate its capacity several times).
    `mtp`: the launch speculates with the checkpoint's own MTP head, whose attention layers keep a
    KV cache too."""
    if not (config.attention_layers and config.num_key_value_heads and config.head_dim):
        return None
    if hybrid and not config.state_layers_known:
        return None
    state: list[StateLayers] = []
    model_bytes = DTYPE_BYTES.get(config.torch_dtype, 2)
    ssm_bytes = DTYPE_BYTES[config.mamba_ssm_dtype] if config.mamba_ssm_dtype else model_bytes
    if config.linear_attention_layers:
        c = config
        state.append(StateLayers(layers=c.linear_attention_layers,
                                 conv_channels=2 * c.linear_num_key_heads * c.linear_key_head_dim
                                 + c.linear_num_value_heads * c.linear_value_head_dim,
                                 conv_kernel=c.linear_conv_kernel_dim,
                                 ssm_elements=c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim,
                                 ssm_bytes=ssm_bytes, conv_bytes=model_bytes))
    if config.mamba_layers:
        c = config
        state.append(StateLayers(layers=c.mamba_layers,
                                 conv_channels=c.mamba_num_heads * c.mamba_head_dim + 2 * c.mamba_n_groups * c.ssm_state_size,
                                 conv_kernel=c.conv_kernel,
                                 ssm_elements=c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size,
                                 ssm_bytes=ssm_bytes, conv_bytes=model_bytes))
    full = config.attention_layers + (config.mtp_layers or 0) * mtp
    attention = [AttentionLayers(full, config.num_key_value_heads, config.head_dim)]
    if config.sliding_window_layers:
        attention.append(AttentionLayers(config.sliding_window_layers, config.num_key_value_heads, config.head_dim,
                                         window=config.sliding_window))
    return KvShape(attention=tuple(attention), state=tuple(state))


def _per_stage(layers: int, pp: int) -> int:
    return math.ceil(layers / pp)


def kv_capacity(shape: KvShape, kv_pool_gib: float, *, max_model_len: int, kv_dtype: str | None = "auto",
                tp: int = 1, pp: int = 1, spec_tokens: int = 0, prefix_caching: bool = False,
                max_num_batched_tokens: int | None = None) -> KvCapacity:
    """The tokens and full-length requests a node's KV pool holds, as vLLM's v1 KV cache manager
    lays it out (see the module docstring): pages unified over the layer kinds, layers grouped,
    blocks shared by every group, and the capacity vLLM reports (concurrency x --max-model-len).
    `spec_tokens`: speculative tokens per step (each widens the conv state and takes a state block);
    `prefix_caching`: --enable-prefix-caching, which puts state layers in "align" mode (2 blocks)."""
    if max_model_len <= 0:
        raise PlanError("--max-model-len must be positive")
    if not shape.attention and not shape.state:
        raise PlanError("the model has no layers that keep a cache")
    mnbt = max_num_batched_tokens or VLLM_MAX_NUM_BATCHED_TOKENS
    attn = [(a, a.bytes_per_token(kv_dtype, tp), _per_stage(a.layers, pp)) for a in shape.attention]
    states = [(s, s.bytes_per_sequence(tp, spec_tokens), _per_stage(s.layers, pp)) for s in shape.state]
    state_page = max((b for _, b, _ in states), default=0)
    if states and attn:
        # the attention block grows, in steps of 16 tokens, until its page covers one state page
        # (vllm/model_executor/models/config.py: HybridAttentionMambaModelConfig)
        widest = max(b for _, b, _ in attn)
        block = VLLM_BLOCK_SIZE * math.ceil(state_page / (VLLM_BLOCK_SIZE * widest))
    else:
        block = VLLM_BLOCK_SIZE
    page = max([block * b for _, b, _ in attn] + [state_page])
    kinds: list[tuple[int, int]] = []  # (layers on this node, blocks one full-length request takes)
    for a, b, n in attn:
        if page % (block * b):
            raise PlanError(f"vLLM cannot unify a page of {block * b} bytes with one of {page}")
        tokens_per_block = block * (page // (block * b))
        if a.window is None:
            need = math.ceil(max_model_len / tokens_per_block)
        else:  # SlidingWindowSpec.max_memory_usage_bytes
            need = math.ceil(min(a.window - 1 + mnbt, max_model_len) / tokens_per_block) + 1
        kinds.append((n, need))
    for _, _, n in states:  # MambaSpec.max_memory_usage_bytes: "align" 2, else 1, + speculative
        kinds.append((n, (2 if prefix_caching else 1) + spec_tokens))
    counts = [n for n, _ in kinds]
    group = min(counts) if max(counts) >= GROUP_SIZE_SLACK * min(counts) else max(counts)
    per_request = sum(math.ceil(n / group) * need for n, need in kinds)
    blocks = max(0, int(kv_pool_gib * GIB) // page // group)
    conc = blocks / per_request
    min_tokens = min(block * (page // (block * b)) for _, b, _ in attn) if attn else block
    return KvCapacity(tokens=int(conc * max_model_len), concurrency=conc, block_size=min_tokens, page_bytes=page,
                      group_size=group, blocks=blocks, blocks_per_request=per_request)


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
