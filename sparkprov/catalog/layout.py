"""Parallel layouts across Sparks (one GPU each): tensor (tp) x pipeline (pp) stages of one engine,
data-parallel replicas (dp) of it, expert parallelism (ep) for MoE models, and the executor.

The rules, checked here once for `invoke recipe`, `cluster-up` and the playbooks (pure: no host):

* tp x pp x dp = the GPUs of the hosts, one per Spark (G35); tp is one the recipe runs at.
* Data-parallel replicas run on vLLM's own (native) executor: rank 0 serves the one API and the
  others are `--headless` engines (`--data-parallel-size/-size-local/-address/-rpc-port`,
  `--data-parallel-start-rank`; vLLM's data_parallel_deployment docs). Each replica is one Spark
  (tp x pp = 1): a replica spanning Sparks would mix vLLM's multi-node ranks with its DP ranks,
  which sparkprov does not render; run such replicas as separate deployments behind the gateway.
* `--enable-expert-parallel` only for MoE recipes, and only where experts are split (tp x dp > 1).
* The image's vLLM must have every flag the layout renders (the recorded set of its version):
  a version without them refuses the layout, naming the image and the version.
* What the fabric's topology cannot carry (facts/topology.py): on a ring of four Sparks or more,
  tensor parallelism on vLLM's own executor only, ranks placed along the ring (TOPOLOGY_RULES, each
  with its source), refused before any host from the declared `fabric_topology`, and again at the
  preflight from the topology provision recorded on the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from sparkprov.catalog.models import NATIVE_MULTINODE_SINCE
from sparkprov.errors import InputError

if TYPE_CHECKING:
    from sparkprov.catalog.knownflags import FlagSet
    from sparkprov.catalog.load import Catalog
    from sparkprov.catalog.models import Image, ResolvedRecipe

GPUS_PER_SPARK = 1  # a DGX Spark has one GB10 GPU
EXECUTORS = ("ray", "native")
# the vLLM options each part of a layout renders (serving/spec.py, catalog/render.py)
NATIVE_FLAGS = ("--distributed-executor-backend", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                "--headless")
DP_FLAGS = ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-address",
            "--data-parallel-rpc-port", "--data-parallel-start-rank", "--headless")
# the layout's sizes: set by the deployment, never by an override
SIZE_FLAGS = {"--tensor-parallel-size": "tp", "--pipeline-parallel-size": "pp", "--data-parallel-size": "dp",
              "--enable-expert-parallel": "ep"}


# What a topology cannot carry, with the source of each rule. A ring of four Sparks or more has no
# link between opposite nodes: eugr/spark-vllm-docker cluster_topology.py (validate_launch, a10c3f7)
# refuses Ray there ("requires the native backend with fixed rank placement") and any pp or dp
# ("supports tensor parallelism only"), and orders ranks along the physical ring; MiaAI-Lab
# DeepSeek-v4.1-Flash-DGX-Sparks PR#3: NCCL's tree between opposite nodes of a 4-ring never connects.
RING_SOURCE = "eugr/spark-vllm-docker cluster_topology.py validate_launch (rings of 4 or more)"
TOPOLOGY_RULES = {
    "ring-ray": ("a ring of {n} Sparks runs vLLM's own executor only: Ray places ranks itself, not along the ring",
                 "--executor native"),
    "ring-pp-dp": ("a ring of {n} Sparks carries tensor parallelism only (pp 1, dp 1): pipeline stages and "
                   "replicas need paths between Sparks the ring has no link for", "--tp {n} --pp 1 --dp 1"),
    "ring-part": ("{n} of a ring's {size} Sparks are a chain, not a ring: its ends share no link",
                  "the whole ring ({size} Sparks), or two cabled neighbours"),
}


def topology_problem(layout: "Layout", topology: str | None, ring_size: int | None = None) -> tuple[str, str] | None:
    """(why, fix) when the fabric's topology cannot carry the layout; None when it can or is unknown.
    `ring_size`: the Sparks of the ring (None: the layout's own)."""
    n = layout.nodes
    if topology != "ring" or n <= 2:
        return None
    if ring_size and n != ring_size:
        why, fix = TOPOLOGY_RULES["ring-part"]
        return f"{why.format(n=n, size=ring_size)} ({RING_SOURCE})", fix.format(size=ring_size)
    if layout.pp > 1 or layout.dp > 1:
        why, fix = TOPOLOGY_RULES["ring-pp-dp"]
    elif layout.executor == "ray":
        why, fix = TOPOLOGY_RULES["ring-ray"]
    else:
        return None
    return f"{why.format(n=n)} ({RING_SOURCE})", fix.format(n=n)


def ring_order_problem(hosts: list[str], cables: list) -> str | None:
    """Why the ranks (`hosts`, rank 0 first) do not follow the ring's cabling (`cables`: pairs of
    (host, port)); None when each rank is cabled to the next (and the last to the first)."""
    linked = {frozenset((a[0], b[0])) for a, b in cables}
    for a, b in zip(hosts, hosts[1:] + hosts[:1]):
        if frozenset((a, b)) not in linked:
            return (f"ranks {', '.join(hosts)} do not follow the ring: {a} and {b} share no cable; order the hosts "
                    f"along the cabling ({RING_SOURCE})")
    return None


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False
    executor: str | None = None  # ray | native; None: one Spark

    @property
    def engine_gpus(self) -> int:
        """The GPUs of one replica's engine (tp x pp)."""
        return self.tp * self.pp

    @property
    def nodes(self) -> int:
        """Sparks the layout takes: tp x pp x dp (one GPU per Spark)."""
        return self.tp * self.pp * self.dp // GPUS_PER_SPARK

    def describe(self) -> str:
        parts = [f"tp {self.tp}"] + [f"pp {self.pp}"] * (self.pp > 1) + [f"dp {self.dp}"] * (self.dp > 1)
        return " x ".join(parts) + (" +ep" if self.ep else "") + (f" ({self.executor})" if self.executor else "")

    def options(self) -> str:
        """The command-line options that select this layout."""
        out = [f"--tp {self.tp}"] + [f"--pp {self.pp}"] * (self.pp > 1) + [f"--dp {self.dp}"] * (self.dp > 1)
        out += ["--ep"] * self.ep + [f"--executor {self.executor}"] * bool(self.executor and self.nodes > 1)
        return " ".join(out)

    def flags(self) -> tuple[str, ...]:
        """The vLLM options its launches carry, beyond the recipe's own."""
        out: list[str] = []
        if self.tp > 1:
            out.append("--tensor-parallel-size")
        if self.pp > 1:
            out.append("--pipeline-parallel-size")
        if self.engine_gpus > 1:
            out += NATIVE_FLAGS if self.executor == "native" else ("--distributed-executor-backend",)
        if self.dp > 1:
            out += DP_FLAGS
        if self.ep:
            out.append("--enable-expert-parallel")
        return tuple(dict.fromkeys(out))


def check_layout(recipe: ResolvedRecipe, info: Image | None, layout: Layout, *, flagset: FlagSet | None = None,
                 hosts: int | None = None, topology: str | None = None, ring_size: int | None = None) -> None:
    """Refuse a layout that cannot run (InputError, one line with the fix). `info`: the catalog's
    record of the recipe's image; `flagset`: its vLLM's options (None: not known, not checked);
    `hosts`: how many Sparks the deployment has (None: not known yet). The one rule `invoke
    recipe`, `invoke plan` and cluster-up share: an executor is refused only where the catalog
    knows the image cannot run it; one it does not know about is checked on the hosts by
    cluster-up's preflight (see `unverified_executor`), and Ray missing from an image is baked
    into a derived image by cluster-up."""
    if layout.tp not in recipe.tp_sizes:
        raise InputError(f"--tp {layout.tp}: {recipe.alias} runs at tp {', '.join(map(str, recipe.tp_sizes))} (G35)",
                         fix=f"--tp {min(recipe.tp_sizes)}")
    if layout.dp > 1:
        if layout.executor == "ray":
            raise InputError("--dp: data-parallel replicas run on vLLM's own multi-node executor, not on Ray",
                             fix="--executor native (or leave --executor out)")
        if layout.engine_gpus > 1:
            raise InputError(f"--dp {layout.dp} with tp {layout.tp} x pp {layout.pp}: each data-parallel replica "
                             "here is one Spark (tp x pp = 1)",
                             fix="--tp 1 --pp 1 --dp N, or replicas spanning Sparks as separate deployments behind "
                                 "`invoke gateway up`")
    if layout.ep:
        if not recipe.traits.moe:
            raise InputError(f"--ep: {recipe.alias} is not a mixture-of-experts model (expert parallelism splits "
                             "experts)", fix="leave out --ep")
        if layout.tp * layout.dp < 2:
            raise InputError("--ep with tp x dp = 1: there is nothing to split the experts over",
                             fix="--ep with --tp 2 or --dp 2")
    if hosts is not None and layout.nodes != hosts:
        raise InputError(f"{layout.describe()} takes {layout.nodes} Spark(s) ({layout.nodes} GPUs, one per Spark), "
                         f"the hosts are {hosts} (tp x pp x dp must equal them, G35)",
                         fix=f"--hosts with {layout.nodes} hosts (the first is rank 0)")
    if layout.nodes > 1 and info is not None and layout.executor == "native" and info.native_multinode is False:
        raise InputError(f"{recipe.alias} runs {info.ref} (vLLM {info.vllm}), which predates vLLM's native multi-node "
                         f"launch (--nnodes/--headless, vLLM >= {NATIVE_MULTINODE_SINCE}): no native multi-node layout",
                         fix="--executor ray (cluster-up bakes Ray into a derived image where the image ships none)"
                         if layout.dp == 1 else "replicas as separate deployments behind `invoke gateway up`, or a "
                         "recipe on an image with a newer vLLM (invoke images)")
    bad = topology_problem(layout, topology, ring_size)
    if bad:
        raise InputError(f"{layout.describe()}: {bad[0]}", fix=bad[1])
    if flagset is not None:
        missing = [f for f in layout.flags() if not flagset.knows(f)]
        if missing:
            version = info.vllm if info is not None and info.vllm else "unknown"
            raise InputError(f"{layout.describe()}: the vLLM in {recipe.image} (vLLM {version}; {flagset.describe()}) "
                             f"has no {', '.join(missing)}", fix="another layout, or a recipe on an image whose "
                             "vLLM has them (invoke images)")


def unverified_executor(info: Image | None, layout: Layout) -> str | None:
    """What the catalog does not know about the image's multi-node executor for this layout, and
    who checks it: cluster-up's preflight, on the hosts (None: nothing left unknown)."""
    if layout.nodes < 2 or layout.executor is None:
        return None
    if info is None:
        return "the image is not in the catalog: cluster-up's preflight checks it on the hosts"
    if layout.executor == "native" and info.native_multinode is None:
        return (f"the catalog does not record {info.ref}'s vLLM version: whether it has the native multi-node launch "
                f"(vLLM >= {NATIVE_MULTINODE_SINCE}) is checked by cluster-up's preflight, which reads the image's "
                "`vllm serve --help`")
    if layout.executor == "ray" and info.has_ray is None:
        return (f"the catalog does not record whether {info.ref} ships Ray: cluster-up's preflight warns, and a Ray "
                "head without it exits 'ray: command not found' (set ray: in the image's catalog entry)")
    return None


def layout_of(recipe: ResolvedRecipe, catalog: Catalog, layout: Layout, *, hosts: int | None = None,
              topology: str | None = None, ring_size: int | None = None) -> None:
    """check_layout with the catalog's image record and the recorded flag set of its vLLM."""
    from sparkprov.catalog.knownflags import known_flags

    check_layout(recipe, catalog.image(recipe.image), layout, flagset=known_flags(recipe.image, catalog),
                 hosts=hosts, topology=topology, ring_size=ring_size)


def layouts(recipe: ResolvedRecipe, catalog: Catalog, max_nodes: int) -> Iterator[Layout]:
    """Every layout of `recipe` on 1..max_nodes Sparks that check_layout accepts (ep variants
    included for MoE recipes), each multi-node one once per executor its image allows."""
    for tp in sorted(recipe.tp_sizes):
        for pp in range(1, max_nodes + 1):
            for dp in range(1, max_nodes + 1):
                if tp * pp * dp > max_nodes:
                    continue
                for ep in (False, True):
                    for executor in (EXECUTORS if tp * pp * dp > 1 else (None,)):
                        lay = Layout(tp, pp, dp, ep, executor)
                        try:
                            layout_of(recipe, catalog, lay)
                        except InputError:
                            continue
                        yield lay


def override_conflicts(overrides: dict, layout: Layout) -> str | None:
    """Why an override may not set a size flag (None: none set one against the layout). The sizes
    come from the deployment's tp/pp/dp/ep; an override equal to them changes nothing."""
    for flag, field in SIZE_FLAGS.items():
        if flag not in overrides:
            continue
        value, want = overrides[flag], getattr(layout, field)
        if field == "ep":
            if bool(value) != want:
                return f"{flag} comes from the deployment's ep ({'true' if want else 'false'})"
            continue
        if str(value) != str(want):
            return f"{flag} {value} conflicts with the deployment's {field} {want} (set {field}: instead)"
    return None
