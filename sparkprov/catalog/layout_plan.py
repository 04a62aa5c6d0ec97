"""What `invoke plan MODEL` computes (pure: literal numbers in, plans out; no host is read).

Every layout of one catalog model on N Sparks (one GPU each, so tp x pp x dp = N): one engine over
tp x pp Sparks, or dp replicas of a smaller engine. For each, the memory of every node from the
memory planner (catalog/memory.py: the utilization budget, the node's share of the weights, the
runtime overhead, the KV pool that is left and the tokens it holds), whether the layout rules
allow it (catalog/layout.py: the recipe's TP sizes, the image's executors and flags), and the
measured bench results stored for that recipe and layout (serving/bench.py). Then the one it
would pick, by the rule in `pick` (stated there and in docs/memory-planner.md).

Per node, for a layout tp x pp (a replica of dp is one such engine):

    weights   = the model's runtime weights / (tp x pp)   (TP splits every layer, PP the layers)
    KV pool   = utilization x host memory - weights - runtime overhead
    tokens    = what the pool holds as vLLM lays it out, from the layers' kinds on that node
                (memory.kv_capacity: KV heads / tp, replicated when fewer than tp; the layers
                / pp; a linear-attention or Mamba state per sequence): the engine's capacity
                (every node holds its slice of every token); dp replicas hold dp times that

A layout fits when every node's pool holds at least one --max-model-len sequence (vLLM refuses to
start otherwise) and the host keeps its headroom (memory.plan_host). One Spark's figures come
from memory's single-node plan, so a figure the notes measured (kv_measured) is used as measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from sparkprov.catalog.memory import (GIB, HOST_MEMORY_GIB, MIN_HEADROOM_GIB, RUNTIME_OVERHEAD_GIB, KvSettings,
                                      KvShape, ModelPlan, PlanError, plan_host, plan_model)

if TYPE_CHECKING:
    from sparkprov.catalog.load import Catalog
    from sparkprov.catalog.models import ResolvedRecipe

# The measurements the pick rule rests on (issue 23 quotes them):
# unsloth PR#10280 (two Sparks over ConnectX-7, GB10): tensor parallel 2.09x (median TPOT 332.7 ms
# -> 162.4 ms), pipeline parallel 1.08x (TPOT flat), two replicas 1.30x at 8 users to 1.91x at 32
# (aggregate decode); issue 23: for gpt-oss-120b two single-Spark replicas behind LiteLLM beat
# TP 2 at 64 concurrent requests. Beside them, one Spark's own curve (004, gpt-oss-120b): 49 output
# tok/s at 1 request, 102 at 4, 207 at 16, 444 at 64: aggregate throughput keeps growing with the
# requests one engine takes, so two engines each at half the load add up, where TP 2 (004: 70 tok/s
# single-stream against 60 on one Spark) buys latency.
REPLICAS_FROM_CONCURRENCY = 8  # where two replicas first measured ahead (1.30x at 8 users)
MEASURED = ("unsloth PR#10280 (2 Sparks): TP 2.09x per token, PP 1.08x, two replicas 1.30x at 8 users to "
            "1.91x at 32; issue 23: gpt-oss-120b two replicas beat TP 2 at 64 concurrent")

ONE_ENGINE, DP_ONE_API, GATEWAY = "one engine", "dp, one API", "replicas behind the gateway"


@dataclass(frozen=True)
class Spark:
    """One Spark as the planner sees it: from inventory vars, else the GB10 constants."""

    name: str
    host_gib: float = HOST_MEMORY_GIB
    utilization_cap: float | None = None  # G18: a modeset=0 host's cap (max_gpu_memory_utilization)
    other_services_gib: float = 0.0
    min_headroom_gib: float = MIN_HEADROOM_GIB


@dataclass(frozen=True)
class ModelFigures:
    """What the layouts need of one model (one Spark, tp 1): from the recipe and memory's plan."""

    alias: str
    utilization: float
    weights_gib: float | None  # the whole model at its runtime size
    shape: KvShape | None  # its layers by cache kind (None: not known, no token figures)
    kv: KvSettings  # KV dtype, --max-model-len, speculative tokens, prefix caching
    single: ModelPlan | None = None  # memory's one-Spark plan (measured figures where the notes have them)
    kv_source: str = "layers"

    @property
    def max_model_len(self) -> int | None:
        return self.kv.max_model_len

    @property
    def bytes_per_token(self) -> float | None:
        """What a token of a full-length request costs on one Spark (its share of any state): as
        measured where a note logged the launch, else from the layers (whatever the pool)."""
        if self.kv_source == "measured" and self.single is not None:
            return self.single.bytes_per_token
        if self.shape is None or not self.max_model_len:
            return None
        try:
            return self.kv.capacity(self.shape, 1.0).bytes_per_token(self.max_model_len)
        except PlanError:
            return None


@dataclass(frozen=True)
class NodeMemory:
    host: str
    utilization: float
    budget_gib: float
    weights_gib: float | None
    overhead_gib: float
    kv_pool_gib: float | None
    bytes_per_token: float | None
    tokens: int | None
    headroom_gib: float
    problems: tuple[str, ...] = ()
    measured: bool = False  # the pool is one a note measured (memory's one-Spark plan), not the formula

    def as_dict(self) -> dict:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class LayoutPlan:
    tp: int
    pp: int
    dp: int
    executor: str | None
    mode: str
    nodes: tuple[NodeMemory, ...]
    refused: str | None = None  # a layout rule refuses it (why)
    unverified: str | None = None  # what the catalog does not know of the image for it (cluster-up's preflight checks)
    does_not_fit: str | None = None  # memory refuses it (the numbers)
    engine_tokens: int | None = None  # one engine's (replica's) capacity: the smallest node's
    demand_tokens: int | None = None  # --max-model-len x the requests one replica takes
    bench: dict | None = None  # the latest stored bench run of this recipe and layout

    @property
    def sparks(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def fits(self) -> bool:
        return self.refused is None and self.does_not_fit is None

    @property
    def covers(self) -> bool | None:
        if self.engine_tokens is None or self.demand_tokens is None:
            return None
        return self.engine_tokens >= self.demand_tokens

    @property
    def total_tokens(self) -> int | None:
        return None if self.engine_tokens is None else self.engine_tokens * self.dp

    def describe(self) -> str:
        if self.dp > 1 and self.tp * self.pp == 1:
            return f"{self.dp} replicas"
        parts = [f"tp {self.tp}"] + [f"pp {self.pp}"] * (self.pp > 1)
        one = " x ".join(parts)
        return f"{self.dp} replicas of {one}" if self.dp > 1 else one

    def options(self) -> str:
        if self.mode == GATEWAY:
            return (f"{self.dp} deployments of --tp {self.tp}" + (f" --pp {self.pp}" if self.pp > 1 else "")
                    + ", then invoke gateway up")
        out = [f"--tp {self.tp}"] + [f"--pp {self.pp}"] * (self.pp > 1) + [f"--dp {self.dp}"] * (self.dp > 1)
        if self.executor and self.sparks > 1:
            out.append(f"--executor {self.executor}")
        return " ".join(out)

    def as_dict(self) -> dict:
        return {"layout": self.describe(), "tp": self.tp, "pp": self.pp, "dp": self.dp, "sparks": self.sparks,
                "executor": self.executor, "mode": self.mode, "options": self.options(), "fits": self.fits,
                "refused": self.refused, "unverified": self.unverified, "does_not_fit": self.does_not_fit, "engine_tokens": self.engine_tokens,
                "total_tokens": self.total_tokens, "demand_tokens": self.demand_tokens, "covers": self.covers,
                "nodes": [n.as_dict() for n in self.nodes], "bench": self.bench}


def shapes(sparks: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp x pp x dp = sparks, largest tp first."""
    out = []
    for tp in range(sparks, 0, -1):
        if sparks % tp:
            continue
        for pp in range(1, sparks // tp + 1):
            if (sparks // tp) % pp == 0:
                out.append((tp, pp, sparks // tp // pp))
    return out


def node_memory(model: ModelFigures, spark: Spark, tp: int, pp: int,
                overhead_gib: float = RUNTIME_OVERHEAD_GIB) -> NodeMemory:
    """One node of a tp x pp engine on `spark` (see the module docstring for the formulas)."""
    util = min(model.utilization, spark.utilization_cap or 1.0)
    measured = (tp * pp == 1 and model.single is not None and util == model.single.gpu_memory_utilization
                and spark.host_gib == HOST_MEMORY_GIB and model.kv_source == "measured")
    if measured:
        plan = model.single  # memory's own plan of the recipe: the pool a note measured
    else:
        weights = None if model.weights_gib is None else model.weights_gib / (tp * pp)
        plan = plan_model(model.alias, gpu_memory_utilization=util, weights_gib=weights,
                          max_model_len=model.max_model_len, host_gib=spark.host_gib, overhead_gib=overhead_gib)
        plan = _with_capacity(plan, model, tp, pp)
    host = plan_host([plan], host=spark.name, other_services_gib=spark.other_services_gib, host_gib=spark.host_gib,
                     min_headroom_gib=spark.min_headroom_gib)
    return NodeMemory(host=spark.name, utilization=util, budget_gib=plan.budget_gib, weights_gib=plan.weights_gib,
                      overhead_gib=plan.overhead_gib, kv_pool_gib=plan.kv_pool_gib, bytes_per_token=plan.bytes_per_token,
                      tokens=plan.pool_tokens, headroom_gib=host.headroom_gib,
                      problems=tuple(str(p) for p in host.problems), measured=measured)


def _with_capacity(plan: ModelPlan, model: ModelFigures, tp: int, pp: int) -> ModelPlan:
    if model.shape is None or plan.kv_pool_gib is None or not model.max_model_len:
        return plan
    try:
        tokens = model.kv.capacity(model.shape, max(plan.kv_pool_gib, 0.0), tp=tp, pp=pp).tokens
    except PlanError:
        return plan
    bpt = plan.kv_pool_gib * GIB / tokens if tokens and plan.kv_pool_gib > 0 else None
    return replace(plan, pool_tokens=tokens, concurrency=tokens / model.max_model_len, bytes_per_token=bpt)


def _does_not_fit(nodes: tuple[NodeMemory, ...], max_model_len: int | None) -> str | None:
    for n in nodes:
        if n.weights_gib is not None and n.kv_pool_gib is not None and n.kv_pool_gib <= 0:
            return (f"does not fit: {n.host} budget {n.budget_gib:.1f} GiB (util {n.utilization:.2f}) - weights "
                    f"{n.weights_gib:.1f} GiB - overhead {n.overhead_gib:.1f} GiB = KV pool {n.kv_pool_gib:.1f} GiB")
        if n.tokens is not None and max_model_len and n.tokens < max_model_len:
            return (f"does not fit: {n.host} KV pool {n.kv_pool_gib:.1f} GiB holds {n.tokens:,} tokens, less than "
                    f"one --max-model-len {max_model_len:,} sequence")
        if n.problems:
            return f"does not fit: {n.problems[0]}"
    return None


# (mode, executor, why the rules refuse it or None[, what the catalog leaves to cluster-up's preflight])
Rules = Callable[[int, int, int], tuple]


def plan_layouts(model: ModelFigures, sparks: list[Spark], *, counts: list[int], rules: Rules, concurrency: int,
                 bench: dict[tuple[int, int, int], dict] | None = None) -> list[LayoutPlan]:
    """Every layout on each count of Sparks in `counts` (using the first that many of `sparks`).
    `rules(tp, pp, dp)` -> (mode, executor, why the layout rules refuse it or None)."""
    out = []
    for count in counts:
        hosts = sparks[:count]
        for tp, pp, dp in shapes(count):
            verdict = rules(tp, pp, dp)
            mode, executor, refused = verdict[:3]
            unverified = verdict[3] if len(verdict) > 3 else None
            nodes = tuple(node_memory(model, s, tp, pp) for s in hosts)
            tokens = [n.tokens for n in nodes]
            engine_tokens = min(tokens) if tokens and all(t is not None for t in tokens) else None
            demand = model.max_model_len * math.ceil(concurrency / dp) if model.max_model_len else None
            out.append(LayoutPlan(tp=tp, pp=pp, dp=dp, executor=executor, mode=mode, nodes=nodes,
                                  refused=refused, unverified=unverified, does_not_fit=_does_not_fit(nodes, model.max_model_len),
                                  engine_tokens=engine_tokens, demand_tokens=demand,
                                  bench=(bench or {}).get((tp, pp, dp))))
    return out


@dataclass(frozen=True)
class Pick:
    plan: LayoutPlan | None
    why: str
    rule: tuple[str, ...] = field(default_factory=tuple)


RULE = (
    "1. only layouts the rules allow and whose every node fits (KV pool >= one --max-model-len sequence, "
    "headroom kept)",
    "2. the fewest Sparks",
    "3. a measured bench run at this concurrency for two or more of them: the highest output tok/s",
    f"4. else, concurrency >= {REPLICAS_FROM_CONCURRENCY} and one Spark holds the model: replicas (measured ahead "
    "on aggregate throughput from 8 concurrent requests on)",
    "5. else, of those whose pool covers --max-model-len x concurrency per replica (none: all of them), the largest "
    "tp (per-token latency), then the smallest pp (PP adds capacity, not speed)",
)


def _measured_tps(plan: LayoutPlan, concurrency: int) -> float | None:
    for row in (plan.bench or {}).get("rows") or []:
        if row.get("concurrency") == concurrency and isinstance(row.get("output_throughput"), (int, float)):
            return float(row["output_throughput"])
    return None


def pick(plans: list[LayoutPlan], concurrency: int) -> Pick:
    """The layout `invoke plan` recommends, by RULE (each step narrows the last). The pool's cover
    of --max-model-len x concurrency decides only between layouts no measurement ranks: requests
    are rarely all full-length, and the measurements (MEASURED) were taken on real pools."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        memory = [p for p in plans if p.refused is None]
        why = ("no layout the rules allow fits in memory: more Sparks, a smaller checkpoint, or a lower "
               "--max-model-len" if memory else "the layout rules refuse every layout on these Sparks (each says why)")
        return Pick(None, why, RULE)
    fewest = min(p.sparks for p in fitting)
    pool = [p for p in fitting if p.sparks == fewest]
    measured = [(t, p) for p in pool if (t := _measured_tps(p, concurrency)) is not None]
    if len(measured) >= 2:
        tps, best_plan = max(measured, key=lambda x: x[0])
        return Pick(best_plan, f"measured fastest at concurrency {concurrency}: {tps:.1f} output tok/s "
                               f"(bench {best_plan.bench.get('time', '?')})", RULE)
    replicas = [p for p in pool if p.dp > 1 and p.tp * p.pp == 1]
    if replicas and concurrency >= REPLICAS_FROM_CONCURRENCY:
        chosen = replicas[0]
        return Pick(chosen, f"one Spark holds the model and {concurrency} concurrent requests favour replicas "
                            f"({MEASURED}); {_cover(chosen, concurrency)}", RULE)
    covering = [p for p in pool if p.covers is not False] or pool
    best = sorted(covering, key=lambda p: (-p.tp, p.pp, p.dp))[0]
    cover = _cover(best, concurrency)
    if best.sparks == 1:
        why = f"one Spark; {cover}"
    elif best.tp > 1:
        why = f"{cover}; the largest tp lowers per-token latency ({MEASURED})"
    elif best.pp > 1:
        why = f"{cover}; the recipe's TP sizes leave pipeline stages (PP adds capacity, not speed: {MEASURED})"
    else:
        why = (f"{cover}; no tp layout is allowed, and replicas (independent engines) beat pipeline stages, which "
               f"add capacity, not speed ({MEASURED})")
    return Pick(best, why, RULE)


def _cover(plan: LayoutPlan, concurrency: int) -> str:
    if plan.covers is None:
        return "its pool's token capacity is not known"
    per = -(-concurrency // plan.dp)
    return (f"its pool covers --max-model-len x {per} concurrent per replica" if plan.covers else
            f"its pool holds {plan.engine_tokens:,} tokens per replica, fewer than --max-model-len x {per} (longer "
            "requests wait)")


def latest_bench(records: list[dict], alias: str) -> dict[tuple[int, int, int], dict]:
    """The latest stored bench run of `alias` per layout (tp, pp, dp), from serving/bench.py's
    records: the layout its provenance records, else its tp label (pp and dp then count as 1)."""
    out: dict[tuple[int, int, int], dict] = {}
    for rec in records:
        if rec.get("recipe") != alias:
            continue
        prov = rec.get("provenance")
        layout = prov.get("layout") if isinstance(prov, dict) else None
        where = layout if isinstance(layout, dict) else rec
        try:
            key = (int(where.get("tp") or 1), int(where.get("pp") or 1), int(where.get("dp") or 1))
        except (TypeError, ValueError):
            continue
        if key not in out or str(rec.get("time", "")) > str(out[key].get("time", "")):
            out[key] = rec
    return out


# ---------------------------------------------------------------- from the catalog


def figures_of(recipe: ResolvedRecipe, catalog: Catalog) -> ModelFigures:
    """The model's one-Spark figures: memory's plan of its rendered launch (measured figures and
    runtime quantization included), its layers by cache kind and the launch's KV settings."""
    from sparkprov.catalog.lint import kv_settings, plan_launch
    from sparkprov.catalog.memory import kv_shape_of
    from sparkprov.catalog.render import HostServeContext, render_launch

    launch = render_launch(recipe, HostServeContext(), 1, catalog=catalog)
    single = plan_launch(launch)
    kv = kv_settings(launch)
    measured = recipe.kv_measured is not None and single.pool_tokens == recipe.kv_measured.pool_tokens
    shape = kv_shape_of(recipe.config, hybrid=recipe.traits.hybrid, mtp=kv.mtp) if recipe.config else None
    source = "measured" if measured else "layers" if shape is not None else "unknown"
    return ModelFigures(alias=recipe.alias, utilization=single.gpu_memory_utilization,
                        weights_gib=single.weights_gib, shape=shape, kv=kv, single=single, kv_source=source)


def catalog_rules(recipe: ResolvedRecipe, catalog: Catalog, topology: str | None = None,
                  ring_size: int | None = None) -> Rules:
    """The layout rules of catalog/layout.py for `plan_layouts`: the executor a layout would run on
    (vLLM's own where the image has it, else Ray, which cluster-up bakes into a derived image), and
    why a layout is refused. Replicas of one Spark are one deployment with one API (native dp) where
    the image is known to allow it, else single-Spark deployments behind the gateway; replicas of a
    larger engine are always separate deployments behind the gateway. An executor the catalog does
    not know the image to have is allowed, as cluster-up allows it, with what its preflight checks.
    `topology`: the fabric's (a ring of four or more refuses what it cannot carry: catalog/layout.py
    topology_problem)."""
    from sparkprov.catalog.layout import Layout, layout_of, unverified_executor
    from sparkprov.errors import InputError

    info = catalog.image(recipe.image)
    native = info is not None and "native" in info.executors

    def refusal(layout: Layout) -> str | None:
        try:
            layout_of(recipe, catalog, layout, topology=topology, ring_size=ring_size)
        except InputError as exc:
            return exc.line()
        return None

    def verdict(mode: str, layout: Layout) -> tuple[str, str | None, str | None, str | None]:
        why = refusal(layout)
        return mode, layout.executor, why, None if why else unverified_executor(info, layout)

    def rules(tp: int, pp: int, dp: int) -> tuple[str, str | None, str | None, str | None]:
        engine = tp * pp
        executor = None if engine == 1 else ("native" if native else "ray")
        if dp == 1:
            return verdict(ONE_ENGINE, Layout(tp, pp, 1, False, executor))
        if engine == 1 and native:  # one API over the replicas where the image is known to have it
            one_api = verdict(DP_ONE_API, Layout(1, 1, dp, False, "native"))
            if one_api[2] is None:
                return one_api
        mode, _, why, unverified = verdict(GATEWAY, Layout(tp, pp, 1, False, executor))
        return mode, executor, why, unverified

    return rules
