"""Preflight linter: rules over a rendered launch, one per launch-time gotcha (G-numbers of
spark-gotchas.md). Errors block a launch; warnings print with the reason and the note they come
from. A recipe silences a warning with `lint_ignore: [{rule: G10, reason: ...}]`; errors cannot
be silenced.

Each rule is a small function registered with its G-number, default severity, title and sources.
It yields findings; a rule may lower its own severity to a warning where two notes disagree
(the recipe keeps its note's value and the warning cites both).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

from sparkprov.catalog.derive import is_derived, start_steps
from sparkprov.defaults import RAY_DERIVED_PREFIX
from sparkprov.catalog.knownflags import REPLACED
from sparkprov.catalog.layout import GPUS_PER_SPARK
from sparkprov.catalog.load import Catalog
from sparkprov.catalog.memory import (GIB, HostPlan, KvSettings, ModelPlan, PlanError, gb_to_gib, kv_dtype_bytes,
                                      kv_shape_of, plan_host, plan_model)
from sparkprov.catalog.render import Launch, image_entrypoint
from sparkprov.catalog.models import ResolvedRecipe
from sparkprov.imageref import ImageRef

ERROR = "ERROR"
WARNING = "WARNING"
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    alias: str
    message: str
    fix: str
    sources: tuple[str, ...]
    silenced: str | None = None  # the recipe's lint_ignore reason, for a silenced warning

    def line(self) -> str:
        src = "; ".join(self.sources)
        out = f"{self.severity} {self.rule} {self.alias}: {self.message} (fix: {self.fix}) [{src}]"
        if self.silenced:
            out += f" (silenced: {self.silenced})"
        return out


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    title: str
    sources: tuple[str, ...]
    check: Callable[["Launch", "LintContext"], Iterable["Hit"]]


@dataclass(frozen=True)
class Hit:
    """What a rule yields: message and fix, optionally another severity or other sources."""

    message: str
    fix: str
    severity: str | None = None
    sources: tuple[str, ...] | None = None


@dataclass
class LintContext:
    catalog: Catalog
    colocated: tuple[Launch, ...] = ()  # other launches placed on the same host (G13)
    flags_cache: str | None = None  # dir of cached `vllm serve --help=all` answers (knownflags)
    image_digest: str | None = None  # the digest the host resolved the image to (preflight)
    pinned: bool = False  # the deployment runs by the digest its nodes hold (cluster-up --pin)

    def flag_set(self, launch: Launch):
        from sparkprov.catalog.knownflags import known_flags

        ref = launch.image
        if launch.image_info is not None:
            return known_flags(launch.image_info, self.catalog, self.flags_cache, digest=self.image_digest
                               or ImageRef.parse(ref).digest)
        return known_flags(ref, self.catalog, self.flags_cache, digest=self.image_digest)


RULES: dict[str, Rule] = {}


def rule(rule_id: str, severity: str, title: str, *sources: str):
    def register(fn):
        if rule_id in RULES:
            raise ValueError(f"rule {rule_id} registered twice")
        RULES[rule_id] = Rule(rule_id, severity, title, tuple(sources), fn)
        return fn
    return register


# ---------------------------------------------------------------- helpers

def _repo_tag(image: str) -> tuple[str, str]:
    ref = ImageRef.parse(image)
    return ref.name, ref.tag or "latest"


def _is_upstream(repo: str) -> bool:
    return repo in ("vllm/vllm-openai", "docker.io/vllm/vllm-openai")


# The upstream tags of the CUDA 13 nightly track (001 §6 image table: :nightly / :cu130-nightly),
# optionally dated or with a commit: matched whole, never by substring (`v0.11.0-nightly-fix` or
# `my-cu130-test` are not the nightly track).
_NIGHTLY_TAG = re.compile(r"^(cu130-)?nightly(-(\d{4}-\d{2}(-\d{2})?|\d{8}|[0-9a-f]{7,40}))?$")
_RELEASE_TAG = re.compile(r"^v?\d+\.\d+(\.\d+)?(rc\d+)?$")


def _cite(src) -> str:
    return src.cite() if hasattr(src, "cite") else str(src)


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v is not None else None
    except ValueError:
        return None


def runtime_weights_gib(recipe: ResolvedRecipe, quantization: str | None) -> float | None:
    """Weights as loaded: a BF16 checkpoint quantized at load time (`--quantization fp8` on a
    `fp8-runtime` recipe) holds one byte per parameter instead of two (002: the FP8 run of
    Gemma-4-26B-A4B); everything else at its size on disk."""
    if recipe.size_gb is None:
        return None
    gib = gb_to_gib(recipe.size_gb)
    if recipe.traits.quant == "fp8-runtime" and (quantization or "").lower() == "fp8":
        return gib / 2
    return gib


def kv_settings(launch: Launch) -> KvSettings:
    """What of a launch sizes its KV cache besides the pool: --kv-cache-dtype, --max-model-len,
    speculative tokens (and whether the checkpoint's own MTP head speculates), prefix caching
    (its "align" mode for state layers) and --max-num-batched-tokens (sliding windows)."""
    spec = launch.recipe.speculative or {}
    override = launch.value("--speculative-config")
    if override is not None:
        try:
            spec = json.loads(override)
        except ValueError:
            spec = {}
    tokens = spec.get("num_speculative_tokens") if isinstance(spec, dict) else None
    return KvSettings(kv_dtype=launch.value("--kv-cache-dtype") or "auto",
                      max_model_len=_int(launch.value("--max-model-len")),
                      spec_tokens=tokens if isinstance(tokens, int) and tokens > 0 else 0,
                      mtp=isinstance(spec, dict) and spec.get("method") == "mtp" and not spec.get("model"),
                      prefix_caching=launch.has("--enable-prefix-caching"),
                      max_num_batched_tokens=_int(launch.value("--max-num-batched-tokens")))


def plan_launch(launch: Launch) -> ModelPlan:
    """The memory plan of one launch on its node (weights and KV split by TP).

    The pool is budget - weights - overhead; the tokens it holds come from each layer's kind
    (memory.kv_capacity over the config's layers: full attention, sliding window, linear-attention
    and Mamba state), laid out as vLLM does. A note's startup log wins where the launch is the one
    it logged (KV dtype, --max-model-len, one node): its pool and tokens as logged; at another
    utilization its pool moves GiB for GiB (weights and overhead stay) at the logged tokens per GiB."""
    r, tp = launch.recipe, launch.tp
    util = launch.number("--gpu-memory-utilization") or VLLM_DEFAULT_UTILIZATION
    util = min(util, 1.0)
    kv = kv_settings(launch)
    host_gib = launch.ctx.host_memory_gib
    m = r.kv_measured
    if m is not None and m.weights_gib is not None and tp == 1:
        weights = m.weights_gib
    else:
        w = runtime_weights_gib(r, launch.value("--quantization"))
        weights = None if w is None else w / tp
    kv_pool: float | None = None
    measured_tokens: int | None = None
    same = (m is not None and tp == 1 and _same_dtype(kv.kv_dtype, m.kv_cache_dtype)
            and (m.max_model_len is None or m.max_model_len == kv.max_model_len))
    if same and abs(util - m.gpu_memory_utilization) < 1e-9:
        measured_tokens = m.pool_tokens
        kv_pool = m.pool_gib
    elif same and m.pool_gib is not None:  # the same launch at another utilization: the logged tokens per GiB
        kv_pool = m.pool_gib + (util - m.gpu_memory_utilization) * host_gib
        measured_tokens = int(max(kv_pool, 0.0) * GIB // m.bytes_per_token)
    plan = plan_model(r.alias, gpu_memory_utilization=util, weights_gib=weights, max_model_len=kv.max_model_len,
                      max_num_seqs=_int(launch.value("--max-num-seqs")), host_gib=host_gib, kv_pool_gib=kv_pool)
    shape = kv_shape_of(r.config, hybrid=r.traits.hybrid, mtp=kv.mtp) if r.config else None
    tokens = measured_tokens
    if tokens is None and shape is not None and plan.kv_pool_gib is not None and kv.max_model_len:
        try:
            tokens = kv.capacity(shape, max(plan.kv_pool_gib, 0.0), tp=tp).tokens
        except PlanError:
            tokens = None
    if tokens is None:
        return plan
    bpt = plan.kv_pool_gib * GIB / tokens if tokens and plan.kv_pool_gib else None
    conc = tokens / plan.max_model_len if plan.max_model_len else None
    return replace(plan, pool_tokens=tokens, concurrency=conc, bytes_per_token=bpt)


def _same_dtype(a: str | None, b: str | None) -> bool:
    try:
        return kv_dtype_bytes(a) == kv_dtype_bytes(b)
    except PlanError:
        return False


def plan_launches(launches: list[Launch]) -> HostPlan:
    ctx = launches[0].ctx
    return plan_host([plan_launch(l) for l in launches], host=ctx.host, other_services_gib=ctx.other_services_gib,
                     host_gib=ctx.host_memory_gib, min_headroom_gib=ctx.min_headroom_gib)


# ---------------------------------------------------------------- images and entrypoints

@rule("G1", ERROR, "image must support GB10 (sm_121)", "001 §2", "000 Gotcha 1")
def g1_image(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    repo, tag = _repo_tag(launch.recipe.image)
    if _is_upstream(repo) and tag.startswith("gemma4") and "cu130" not in tag:
        return  # G3's case
    info = launch.image_info
    stable = _is_upstream(repo) and (tag == "latest" or _RELEASE_TAG.match(tag) is not None)
    fix = "use vllm/vllm-openai:cu130-nightly (or :nightly) or nvcr.io/nvidia/vllm:26.04-py3"
    if info is not None and info.device == "cpu":
        yield Hit(f"{launch.recipe.image} is a CPU build of vLLM: it serves on the CPU (the lab), never on the "
                  "Spark's GPU", fix, severity=WARNING, sources=(_cite(info.source),))
    elif info is not None and info.gb10 is False:
        yield Hit(f"{launch.recipe.image} does not run on GB10 (sm_121): failures look like model or flag problems",
                  fix, sources=(_cite(info.source), "001 §2"))
    elif stable and info is not None and info.gb10:
        yield Hit(f"{launch.recipe.image} is an upstream stable tag, which does not support GB10, but the catalog "
                  "records it as validated for this model", "keep it only for the model it was validated for",
                  severity=WARNING, sources=("001 §2", _cite(info.source)))
    elif stable:
        yield Hit(f"{launch.recipe.image} is the upstream stable image, which does not support GB10 (sm_121)", fix)
    elif info is None:
        if repo == "nvcr.io/nvidia/vllm":
            m = re.match(r"(\d\d)\.(\d\d)", tag)
            if m and (int(m[1]), int(m[2])) < (25, 12):
                yield Hit(f"{launch.recipe.image} predates NGC's Spark support", "use nvcr.io/nvidia/vllm:26.04-py3")
        elif not (_is_upstream(repo) and _NIGHTLY_TAG.match(tag)):
            yield Hit(f"sparkprov does not know whether {launch.recipe.image} runs on sm_121",
                      "add the image to an `images:` list with gb10: true and its source, or use a known image",
                      severity=WARNING)


@rule("G2", ERROR, "entrypoint style must match the image", "001 §6 Important")
def g2_entrypoint(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    r = launch.recipe
    kind = image_entrypoint(r.image, launch.image_info)
    # With sparkprov's API-key wrapper the entrypoint is `sh` and the wrapper execs `vllm serve` itself:
    # `command: full` then runs exactly one `vllm serve`, nothing to report.
    if r.command == "full" and kind == "vllm-serve" and not launch.wrapped:
        yield Hit(f"{r.image} already has `vllm serve` as entrypoint; `command: full` runs `vllm serve vllm serve "
                  "MODEL` and fails with 'unrecognized arguments: serve'", "remove `command: full` (pass model + flags only)")
    elif r.command == "bare" and kind == "passthrough":
        yield Hit(f"{r.image} (NGC) takes the full `vllm serve MODEL ...`; `command: bare` makes its entrypoint run "
                  "the model name as a program", "remove `command: bare`")
    if r.model.served_ref in ("serve", "vllm", "vllm serve"):
        yield Hit(f"the model is {r.model.served_ref!r}: `vllm serve` written into the arguments",
                  "set model.repo to the Hugging Face repo")


# Model families that need a given vLLM, as the notes say (checked where the image's version is known).
FAMILY_MIN_VLLM = {
    "gemma4": ("0.23", "001 §7.2 Important: Gemma 4 needs vllm/vllm-openai:gemma4-cu130 (or the 0.23 nightly track)"),
    "qwen3.5": ("0.23", "001 §7.1.4: Needs a recent vLLM (build from main or current nightly) and Transformers 5+"),
}
METHOD_MIN_VLLM = {
    "dflash": ("0.21", "001 §14.7: DFlash floor: vLLM >= 0.21.0 (AEON-7/Z-Lab image or nightly)"),
    "mtp": ("0.19", "001 §14.7: MTP is fine on 0.19.0+"),
}


@rule("G3", ERROR, "the image's vLLM must be one the model (and its method) runs on", "001 §7.2 Important", "001 §6")
def g3_gemma_image(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    repo, tag = _repo_tag(launch.recipe.image)
    if _is_upstream(repo) and tag.startswith("gemma4") and "cu130" not in tag.split("-"):
        yield Hit(f"{launch.recipe.image} is v0.18.2-dev and crashes on sm121 with '[FP4 gemm Runner] Failed to run "
                  "cutlass FP4 gemm'", "use vllm/vllm-openai:gemma4-cu130")
        return
    r, info = launch.recipe, launch.image_info
    if info is None or info.vllm is None:
        return
    need = FAMILY_MIN_VLLM.get(r.traits.family)
    gemma_build = _is_upstream(repo) and tag.startswith("gemma4") and "cu130" in tag.split("-")
    if need and not gemma_build and info.vllm_at_least(need[0]) is False:
        yield Hit(f"{r.traits.family} on {r.image}, whose vLLM is {info.vllm}: the notes run it on vLLM "
                  f">= {need[0]}", "use vllm/vllm-openai:nightly (or the image the model's recipe names)",
                  sources=(need[1],))
    spec = launch.speculative or {}
    method = spec.get("method")
    need = METHOD_MIN_VLLM.get(method) if isinstance(method, str) else None
    if need and method != "dflash" and info.vllm_at_least(need[0]) is False:  # DFlash: G29 owns it
        yield Hit(f"speculative method {method} on {r.image}, whose vLLM is {info.vllm}: it needs >= {need[0]}",
                  "use an image with a newer vLLM", sources=(need[1],))


@rule("G4", ERROR, "pin images; every flag must exist in the image's vLLM", "001 §6 image table")
def g4_pin_and_flags(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    info = launch.image_info
    # (an image cluster-up derives is built FROM its base's ID and tagged by the base reference: as
    # pinned as that reference)
    pinned = (ImageRef.parse(launch.image).digest is not None or lc.pinned
              or (is_derived(launch.image) and info is not None and info.is_pinned))
    if not pinned and launch.ctx.host_known:  # a deployment (G34 covers moving tags across nodes)
        what = "a moving tag" if info is not None and info.moving else "not pinned to a digest"
        yield Hit(f"{launch.recipe.image} is {what}: the same recipe can run different code next week",
                  "pin it: `invoke images --pin --host H` or digest: sha256:... in an images: list; or run "
                  "the deployment by the digest its nodes hold: cluster-up --pin",
                  severity=WARNING,
                  sources=tuple(dict.fromkeys(("001 §6 image table", _cite(info.source) if info else "001 §6"))))
    fs = lc.flag_set(launch)
    if fs is None:
        return
    if info is None:
        from sparkprov.catalog.knownflags import infer_image

        info = infer_image(launch.image)
    version = (info.vllm if info is not None else None) or "?"
    where = f"{launch.recipe.image} (vLLM {version}; {fs.describe()})"
    for a in launch.vllm_args:
        if a.flag is None:
            continue
        src = (_cite(a.source),)
        if not fs.knows(a.flag):
            hint = REPLACED.get(a.flag, "remove it, or use an image whose vLLM has it")
            yield Hit(f"{a.flag} is not an option of the vLLM in {where}: vllm serve exits with "
                      f"'unrecognized arguments'", hint, sources=src + ("001 §6 image table",))
        elif fs.is_deprecated(a.flag):
            yield Hit(f"{a.flag} is deprecated in the vLLM in {where}", REPLACED.get(a.flag, "drop it"),
                      severity=WARNING, sources=src)
    # every VLLM_* variable against the image's vLLM (envs.py of its version; G7 names the MoE ones)
    said = set(G7_NAMES) | (set(LEGACY_MOE_ENV) if info is not None and info.vllm_at_least("0.23") else set())
    for e in launch.env:
        if e.name.startswith("VLLM_") and e.name not in said and fs.knows_env(e.name) is False:
            yield Hit(f"{e.name} is not an environment variable of the vLLM in {where}: vLLM logs 'Unknown vLLM "
                      "environment variable detected' and ignores it",
                      "remove it, or use the flag or variable this vLLM has for the same setting",
                      sources=(_cite(e.source), "001 §6 Caution"))


@rule("G5", WARNING, "image needs a newer driver or CUDA forward compatibility", "001 §7.3.1")
def g5_driver(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    info, have = launch.image_info, launch.ctx.driver_version
    if info is None or not info.min_driver or not have:
        return
    try:
        older = tuple(int(x) for x in have.split(".")) < tuple(int(x) for x in info.min_driver.split("."))
    except ValueError:
        return
    if older:
        yield Hit(f"{info.ref} is built for driver >= {info.min_driver}; {launch.ctx.host} has {have}, so it runs "
                  "through CUDA forward compatibility; 'compatibility mode is UNAVAILABLE' plus a restart loop means "
                  "it cannot", f"update the driver to >= {info.min_driver} or use vllm/vllm-openai:cu130-nightly",
                  sources=(_cite(info.source),))


# ---------------------------------------------------------------- quantization and kernels

@rule("G6", ERROR, "--quantization must match the checkpoint format", "001 §6 Important", "002")
def g6_quantization(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    quant = launch.recipe.traits.quant
    q = launch.value("--quantization")
    q = q.lower().replace("-", "_") if q else None
    if q == "compressed_tensors":
        q = "compressed-tensors"
    if q == "modelopt_fp4":
        q = "modelopt"
    if quant == "nvfp4-modelopt":
        if q is None:
            yield Hit("ModelOpt NVFP4 checkpoint without --quantization modelopt (NVIDIA's own Nemotron recipes "
                      "omit it and rely on auto-detection)", "add --quantization modelopt", severity=WARNING,
                      sources=("001 §6 Important", "001 §7.3.1", "001 §7.3.2"))
        elif q != "modelopt":
            yield Hit(f"ModelOpt NVFP4 checkpoint with --quantization {q}", "use --quantization modelopt")
    elif quant == "nvfp4-ct":
        if q == "compressed-tensors":
            yield Hit("--quantization compressed-tensors on a compressed-tensors checkpoint: 001 says vLLM "
                      "auto-detects and not to pass it; 002 passes it and it worked",
                      "drop --quantization (auto-detected)", severity=WARNING, sources=("001 §6 Important", "002"))
        elif q is not None:
            yield Hit(f"compressed-tensors checkpoint with --quantization {q}: weights mis-load",
                      "drop --quantization (compressed-tensors is auto-detected)")
    elif quant == "mxfp4" and q not in (None, "mxfp4"):
        yield Hit(f"MXFP4 checkpoint with --quantization {q}", "use --quantization mxfp4 or drop it")
    elif quant == "fp8" and q not in (None, "fp8"):
        yield Hit(f"FP8 checkpoint with --quantization {q}: vLLM refuses a method the checkpoint's "
                  "quantization_config does not name, or mis-loads the weights", "drop --quantization (auto-detected)")
    elif quant == "gptq-int4" and q not in (None, "gptq", "gptq_marlin"):
        yield Hit(f"GPTQ checkpoint with --quantization {q}", "drop --quantization (auto-detected) or use gptq_marlin")
    elif quant == "bf16" and q not in (None, "fp8"):
        yield Hit(f"an unquantized BF16 checkpoint with --quantization {q}: {q} reads pre-quantized weights that "
                  "this checkpoint does not have", "drop --quantization, or --quantization fp8 to quantize at load")
    elif quant == "fp8-runtime" and q not in ("fp8", None):
        yield Hit(f"runtime FP8 of a BF16 checkpoint with --quantization {q}", "use --quantization fp8")
    elif quant == "fp8-runtime" and q is None:
        yield Hit("runtime FP8 of a BF16 checkpoint needs --quantization fp8; without it the weights stay BF16",
                  "add --quantization fp8", severity=WARNING, sources=("002",))


# 001 writes VLLM_MXFP4_BACKEND=marlin; the variable vLLM reads is VLLM_MXFP4_USE_MARLIN (vllm/envs.py).
MXFP4_MARLIN_FIX = "set env VLLM_MXFP4_USE_MARLIN=1 (not VLLM_MXFP4_BACKEND, which vLLM does not know)"
LEGACY_MOE_ENV = ("VLLM_USE_FLASHINFER_MOE_FP4", "VLLM_USE_FLASHINFER_MOE_FP8", "VLLM_FLASHINFER_MOE_BACKEND")
G7_NAMES = ("VLLM_USE_FLASHINFER_MOE", "VLLM_MXFP4_BACKEND")  # not vLLM variables: G7 says what they meant


@rule("G7", ERROR, "FP4 MoE on sm_121 must use the Marlin path", "001 §6 Caution", "004")
def g7_fp4_moe(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    r, info = launch.recipe, launch.image_info
    at23 = info.vllm_at_least("0.23") if info else None
    env = {e.name: e.value for e in launch.env}
    if "VLLM_USE_FLASHINFER_MOE" in env:
        yield Hit("VLLM_USE_FLASHINFER_MOE is not a vLLM variable: vLLM logs 'Unknown vLLM environment variable' "
                  "and ignores it", "remove it (use --moe-backend)", severity=WARNING)
    legacy = [k for k in LEGACY_MOE_ENV if k in env]
    if legacy and at23:
        yield Hit(f"{', '.join(legacy)} are ignored on vLLM 0.23+ ({r.image}) and log 'Unknown vLLM environment "
                  "variable'", "remove them and use --moe-backend marlin", severity=WARNING)
    if r.traits.moe and r.traits.quant in ("nvfp4-modelopt", "nvfp4-ct"):
        backend = launch.value("--moe-backend")
        if backend == "marlin":
            return
        if backend is not None:
            yield Hit(f"FP4 MoE with --moe-backend {backend}: sm_121 has no native FP4 MoE kernel (one author found "
                      "flashinfer_cutlass faster on Qwen3.5-122B: A/B it)", "use --moe-backend marlin",
                      severity=WARNING, sources=("001 §6 Caution", "001 §7.1.4"))
        elif at23 is False:
            how = f"uses {', '.join(legacy)}" if legacy else "relies on the automatic backend"
            yield Hit(f"FP4 MoE without --moe-backend marlin: {r.source.cite()} {how} on an older image "
                      f"({r.image}), while 001 says sm_121 FP4 MoE must use Marlin",
                      "if output is garbled ('!!!!!'), add --moe-backend marlin", severity=WARNING,
                      sources=("001 §6 Caution", r.source.cite()))
        else:
            yield Hit("FP4 MoE on sm_121 needs --moe-backend marlin: no native FP4 MoE kernel, CUTLASS FP4 emits "
                      "garbage or fails", "add --moe-backend marlin", sources=("001 §6 Caution", "001 §7.2.2"))
    if "VLLM_MXFP4_BACKEND" in env:
        yield Hit("VLLM_MXFP4_BACKEND (001's spelling) is not a vLLM variable: vLLM logs 'Unknown vLLM environment "
                  "variable' and ignores it, so MXFP4 does not take the Marlin path", MXFP4_MARLIN_FIX,
                  sources=("001 §6 Note", "vLLM envs.py: VLLM_MXFP4_USE_MARLIN"))
    if r.traits.quant == "mxfp4":
        if (env.get("VLLM_MXFP4_USE_MARLIN", "").lower() in ("1", "true")
                or (launch.value("--moe-backend") or "").lower() == "marlin"):
            return
        custom = launch.value("--mxfp4-backend")
        if custom is not None:
            yield Hit(f"MXFP4 through --mxfp4-backend {custom}: 004's community image carries SM121 kernels for it; "
                      "001 says stock images need the Marlin MXFP4 path",
                      "keep it only on an image with SM121 MXFP4 kernels", severity=WARNING, sources=("001 §6", "004"))
        else:
            yield Hit("MXFP4 on sm_121 needs the Marlin path", MXFP4_MARLIN_FIX, sources=("001 §6 Note",))


@rule("G8", WARNING, "smoke test must catch degenerate FP4 output", "001 §6 Note")
def g8_smoke(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    s = launch.smoke
    if launch.recipe.traits.fp4 and (not s.reject_degenerate or s.expect is None):
        yield Hit("FP4 model whose smoke test only checks for HTTP 200: '!!!!!' or empty output (an sm_121 kernel "
                  "problem) would pass", "set smoke.reject_degenerate: true and an expected answer (smoke.expect)")


@rule("G9", ERROR, "no forced FlashInfer attention on hybrid models", "001 §7.1.1")
def g9_attention(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    t = launch.recipe.traits
    backend = (launch.value("--attention-backend") or "").lower()
    if backend != "flashinfer" or not t.hybrid:
        return
    if "mamba2" in t.ssm_layers:
        yield Hit("--attention-backend flashinfer crashes at init_device on hybrids that mix full attention, "
                  "Gated-DeltaNet and Mamba layers", "remove --attention-backend (vLLM picks one per layer)")
    else:
        yield Hit("--attention-backend flashinfer on a Gated-DeltaNet hybrid: 001 §7.1.3 runs it (fits ~170K) but "
                  "§7.1.1 saw it crash Qwen3.6 at init_device", "if init_device fails, remove --attention-backend",
                  severity=WARNING, sources=("001 §7.1.1", "001 §7.1.3"))


# ---------------------------------------------------------------- hybrid (SSM/Mamba) models

@rule("G10", WARNING, "no chunked prefill on SSM hybrids", "000 Gotcha 5", "001 §7.1.1")
def g10_chunked_prefill(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    if launch.has("--enable-chunked-prefill") and launch.recipe.traits.hybrid:
        yield Hit("--enable-chunked-prefill on an SSM hybrid: 000 measured ~50 -> 5.7 tok/s (9x) on Qwen3.5-35B-A3B; "
                  "001's Qwen3.6 recipe uses it", "remove --enable-chunked-prefill")


@rule("G11", ERROR, "Mamba align mode needs max-num-batched-tokens >= block size", "000 Gotcha 6", "002")
def g11_align(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    t = launch.recipe.traits
    if not (t.hybrid and launch.has("--enable-prefix-caching")):
        return
    mnbt = _int(launch.value("--max-num-batched-tokens"))
    need = t.mamba_align_block_size
    if mnbt is None:
        size = f"block_size ({need})" if need else "the Mamba block size (2096-2128 seen)"
        yield Hit(f"prefix caching on a hybrid puts the Mamba cache in align mode; the default "
                  f"max_num_batched_tokens 2048 is below {size} and startup crashes",
                  "add --max-num-batched-tokens 8192 (4096 at least)")
    elif need and mnbt < need:
        yield Hit(f"--max-num-batched-tokens {mnbt} is below the Mamba align block size {need}",
                  f"raise --max-num-batched-tokens to {max(4096, need)} or more")
    elif not need and mnbt < 4096:
        yield Hit(f"--max-num-batched-tokens {mnbt} may be below the Mamba align block size (2096-2128 seen)",
                  "use 4096 or 8192", severity=WARNING)


@rule("G12", WARNING, "coding agents need prefix caching", "001 §7.1.3")
def g12_prefix_caching(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    t = launch.recipe.traits
    agent = launch.has("--tool-call-parser")
    if t.card_disables_prefix_caching and agent and not launch.has("--enable-prefix-caching"):
        yield Hit("the model card disables prefix caching for this architecture; agents re-send a growing prompt "
                  "(0% cache hits = full re-prefill every turn)", "add --enable-prefix-caching")
    if agent and launch.has("--no-enable-prefix-caching"):
        yield Hit("prefix caching switched off on a tool-calling launch", "remove --no-enable-prefix-caching")


# ---------------------------------------------------------------- memory

@rule("G13", ERROR, "utilizations on one host must leave headroom", "001 §2", "002")
def g13_memory(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    util = launch.number("--gpu-memory-utilization")
    if util is not None and not 0 < util <= 1:
        yield Hit(f"--gpu-memory-utilization {util} is not a fraction of the shared pool", "use a value in (0, 1]")
        return
    info = launch.image_info
    if info is not None and info.device == "cpu" and not launch.env_value("VLLM_CPU_KVCACHE_SPACE"):
        yield Hit(f"{launch.recipe.image} is a CPU build: without VLLM_CPU_KVCACHE_SPACE its KV cache takes "
                  f"--gpu-memory-utilization ({util or VLLM_DEFAULT_UTILIZATION:g}) of the host's RAM",
                  "set env VLLM_CPU_KVCACHE_SPACE to the KV cache's GiB", sources=("docs/real-vllm.md",))
    plan = plan_launches([launch, *lc.colocated])
    for problem in plan.problems:
        yield Hit(problem.message, problem.fix)


@rule("G18", ERROR, "a modeset=0 host caps the usable utilization", "002")
def g18_modeset_cap(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    cap = launch.ctx.utilization_cap
    if cap is None:
        return
    util = launch.number("--gpu-memory-utilization") or VLLM_DEFAULT_UTILIZATION
    if util > cap + 1e-9:
        yield Hit(f"--gpu-memory-utilization {util:g} on {launch.ctx.host}, whose kernel parameter modeset=0 caps "
                  f"CUDA-visible memory near 62 GB: above {cap:g} vLLM asks for memory CUDA cannot see",
                  f"lower --gpu-memory-utilization to {cap:g} (or remove modeset=0 from the kernel command line)",
                  sources=("002: caps CUDA-visible memory at ~62 GB ... At 0.55 we get ~65.8 GB reserved",))


@rule("G17", WARNING, "size the KV pool for the requests you serve", "001 §8")
def g17_kv_pool(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    r = launch.recipe
    mml = _int(launch.value("--max-model-len"))
    native = r.traits.native_max_len
    if mml and native and mml > native and launch.env_value("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        yield Hit(f"--max-model-len {mml} is beyond the model's native {native}", "lower it, or set "
                  "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 with a YaRN --hf-overrides block", severity=ERROR)
    plan = plan_launch(launch)
    if plan.pool_tokens is None or not mml:
        return
    if plan.pool_tokens < mml:
        yield Hit(f"the KV pool holds {plan.pool_tokens:,} tokens, less than one --max-model-len {mml:,} request",
                  "raise --gpu-memory-utilization or lower --max-model-len", severity=ERROR)
    elif plan.max_num_seqs and plan.pool_tokens < plan.max_num_seqs * mml:
        yield Hit(f"the KV pool holds {plan.pool_tokens:,} tokens = {plan.concurrency:.2f} full-length requests, "
                  f"fewer than --max-num-seqs {plan.max_num_seqs} x {mml:,}",
                  "lower --max-model-len or --max-num-seqs, or raise --gpu-memory-utilization",
                  sources=("001 §8", r.source_of("kv_measured").cite() if r.kv_measured else r.source.cite()))


# ---------------------------------------------------------------- lifecycle, storage

@rule("G20", WARNING, "wait long enough for a cold start", "000 Startup timeline", "001 §9")
def g20_startup(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    s, size = launch.startup, launch.recipe.size_gb or 0
    if s.health_timeout_s < 300:
        yield Hit(f"health timeout {s.health_timeout_s}s: a cold start takes minutes (weights, torch.compile, "
                  "FlashInfer autotune)", "set startup.health_timeout_s to 900")
    elif size > 60 and s.health_timeout_s < 900:
        yield Hit(f"health timeout {s.health_timeout_s}s for ~{size:g} GB of weights (10-15 min for a 120B)",
                  "set startup.health_timeout_s to 1200")
    if not s.warmup:
        yield Hit("no warm-up request: the first real request pays the JIT (~25-60 s)", "set startup.warmup: true")


@rule("G21", WARNING, "a service must come back after a reboot", "002")
def g21_restart_policy(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    policy = launch.recipe.docker.restart
    if policy == "no":
        yield Hit("restart policy `no`: after a reboot or a crash the model stays down",
                  "use docker.restart: unless-stopped (sparkprov's default) or a systemd unit",
                  sources=("002: Restart=always ... systemd unit", launch.recipe.source_of("docker").cite()))
    elif policy == "on-failure":
        yield Hit("restart policy `on-failure`: vLLM's API server exits with status 0 when its engine dies, "
                  "so the model stays down", "use docker.restart: unless-stopped (sparkprov's default)",
                  sources=("docs/real-vllm.md", launch.recipe.source_of("docker").cite()))


@rule("G22", ERROR, "the model store is sparkprov's", "001 §3")
def g22_store(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    if "HF_HOME" in launch.recipe.env:
        yield Hit("the recipe sets HF_HOME; sparkprov mounts the host's model store at the same path and sets HF_HOME",
                  "remove HF_HOME from env")


@rule("G24", WARNING, "serve offline once staged", "001 §3 Tip")
def g24_offline(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    r = launch.recipe
    if "HF_HUB_OFFLINE" in r.env:
        yield Hit("the recipe sets HF_HUB_OFFLINE; sparkprov always serves with HF_HUB_OFFLINE=1", "remove it from env")
    for cmd in start_steps(r.pre_serve):  # (a plain pip install is baked into a derived image instead)
        for inner in _commands(cmd):
            if _networked(inner):
                via = "" if inner == cmd else f" (inside `{' '.join(cmd)[:60]}`)"
                yield Hit(f"`{' '.join(inner)}`{via} runs at every container start and needs the network",
                          "bake it into a derived image for an offline fleet",
                          sources=("001 §3 Tip", r.source_of("pre_serve").cite()))


_SHELLS = ("sh", "bash", "dash", "zsh", "/bin/sh", "/bin/bash", "/usr/bin/bash", "/usr/bin/env")
_NET_TOOLS = ("pip", "pip3", "apt-get", "apt", "curl", "wget", "uv", "git", "hf", "huggingface-cli", "conda", "npm")


def _commands(cmd: list[str], depth: int = 0) -> list[list[str]]:
    """The simple commands an argv runs: itself, or what a `sh -c SCRIPT` runs (split on ; && || |
    and newlines, nested shells followed). sparkprov's own API-key wrapper is not a recipe command
    and never reaches here."""
    import shlex as _shlex

    words = cmd[1:] if cmd[0] == "/usr/bin/env" else cmd
    if depth < 3 and words and words[0].rsplit("/", 1)[-1] in ("sh", "bash", "dash", "zsh"):
        opts = [w for w in words[1:] if w.startswith("-")]
        script = next((w for w in words[1:] if not w.startswith("-")), None)
        if script is not None and any("c" in o for o in opts):
            out: list[list[str]] = []
            for part in re.split(r"&&|\|\||;|\||\n", script):
                try:
                    argv = _shlex.split(part)
                except ValueError:
                    argv = part.split()
                while argv and "=" in argv[0] and not argv[0].startswith("-"):
                    argv = argv[1:]  # VAR=value prefixes
                if argv and argv[0] in ("exec", "sudo", "env"):
                    argv = argv[1:]
                if argv:
                    out += _commands(argv, depth + 1)
            return out
    return [cmd]


def _networked(argv: list[str]) -> bool:
    name = argv[0].rsplit("/", 1)[-1]
    if name in _NET_TOOLS:
        return True
    return name.startswith("python") and argv[1:3] == ["-m", "pip"]


@rule("G26", ERROR, "gated models need a token and an accepted license", "001 §5")
def g26_gated(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    r = launch.recipe
    gated = ([r.model.repo] if r.gated else []) + [x.repo for x in r.extra_repos if x.gated]
    if gated and launch.ctx.hf_token_available is False:
        yield Hit(f"{', '.join(gated)} is gated and {launch.ctx.host} has no Hugging Face token (a 401 means a "
                  "missing token or an unaccepted license)",
                  "set hf_token_file for the host and accept the license on the model's page")


# ---------------------------------------------------------------- serving flags

@rule("G27", ERROR, "tool calling needs both flags and a matching parser", "001 §7.1.1", "001 §8")
def g27_tools(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    auto, parser = launch.has("--enable-auto-tool-choice"), launch.value("--tool-call-parser")
    if auto and parser is None:
        yield Hit("--enable-auto-tool-choice without --tool-call-parser", "add the parser of the model family")
    if parser is not None and not auto:
        yield Hit("--tool-call-parser without --enable-auto-tool-choice: agents sending tool_choice 'auto' get HTTP 400",
                  "add --enable-auto-tool-choice")
    known = launch.recipe.traits.tool_parsers
    if parser is not None and known and parser not in known:
        yield Hit(f"--tool-call-parser {parser} does not match this model family's output ({', '.join(known)}); the "
                  "parser tracks the model, not the client", f"use --tool-call-parser {known[0]}", severity=WARNING,
                  sources=(launch.recipe.source_of("traits.tool_parsers").cite(), launch.recipe.source.cite()))


@rule("G28", WARNING, "reasoning models: parser and smoke-test thinking", "000 Gotcha 2", "001 §7.1.1")
def g28_reasoning(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    r, s = launch.recipe, launch.smoke
    if r.traits.thinking != "on":
        return
    if not launch.has("--reasoning-parser"):
        yield Hit("thinking is on by default and there is no --reasoning-parser: the <think> block lands in content",
                  "add the family's --reasoning-parser (qwen3 for Qwen3.x)")
    if "enable_thinking" not in s.chat_template_kwargs and s.max_tokens < 1000:
        yield Hit(f"smoke test with thinking on and max_tokens {s.max_tokens}: content null, finish_reason length",
                  "set smoke.chat_template_kwargs: {enable_thinking: false}")


# The keys of vLLM's SpeculativeConfig (vllm/config/speculative.py) a --speculative-config may hold.
SPEC_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "quantization",
             "max_model_len", "revision", "code_revision", "disable_by_batch_size", "disable_padded_drafter_batch",
             "prompt_lookup_max", "prompt_lookup_min", "speculative_token_tree", "enforce_eager",
             "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
             "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "attention_backend",
             "parallel_drafting", "draft_load_config", "target_model_config", "draft_model_config",
             "moe_backend")  # moe_backend: 001 §7.1.1 boots it on 0.23.x ("moe_backend":"triton")
SPEC_METHODS = frozenset({"ngram", "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "deepseek_mtp",
                          "mtp", "qwen3_next_mtp", "ernie_mtp", "glm4_moe_mtp", "longcat_flash_mtp", "mimo_mtp",
                          "suffix", "dflash"})


@rule("G29", ERROR, "speculative decoding settings", "001 §14.7", "002")
def g29_speculative(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    spec = launch.speculative
    if spec is None:
        return
    r, info = launch.recipe, launch.image_info
    method = spec.get("method")
    n = spec.get("num_speculative_tokens")
    kv = (launch.value("--kv-cache-dtype") or "").lower()
    unknown = sorted(k for k in spec if k not in SPEC_KEYS)
    if unknown:
        close = {k: difflib.get_close_matches(k, SPEC_KEYS, n=1) for k in unknown}
        hint = ", ".join(f"{k} -> {c[0]}" for k, c in close.items() if c)
        yield Hit(f"--speculative-config has key(s) vLLM's SpeculativeConfig does not take: {', '.join(unknown)} "
                  "(vLLM refuses the config at startup)", f"fix the key(s){': ' + hint if hint else ''}")
    if method is not None and method not in SPEC_METHODS:
        yield Hit(f"--speculative-config method {method!r} is not one vLLM knows ({', '.join(sorted(SPEC_METHODS))})",
                  "use mtp, dflash, ngram, suffix, eagle3 or draft_model")
    if method in ("ngram", "suffix") and "model" in spec:
        yield Hit(f"{method} speculation is drafter-free: the \"model\" key is ignored or refused",
                  "remove \"model\"", severity=WARNING, sources=("001 §14.7",))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        if method not in ("suffix",) or n is not None:
            yield Hit(f"num_speculative_tokens {n!r}: a positive integer is required", "set num_speculative_tokens",
                      sources=("001 §14.7",))
    if method == "draft_model":
        yield Hit("\"method\":\"draft_model\" runs the full model as drafter (002: mtp was +40%)",
                  "use \"method\":\"mtp\"", severity=WARNING, sources=("002",))
    elif method == "mtp":
        if isinstance(n, int) and n > 3:
            yield Hit(f"MTP with num_speculative_tokens {n}: 001 keeps MTP at 1-3 (each extra token is another pass); "
                      "002 ran 4 with Gemma's matched drafter", "use 1-3", severity=WARNING,
                      sources=("001 §14.7", "002"))
        elif r.traits.family == "qwen3.6" and isinstance(n, int) and n != 2:
            yield Hit(f"Qwen3.6 MTP with num_speculative_tokens {n}: 002 measured 2 as the sweet spot (3+ lowers "
                      "acceptance); 001's recipe uses 3", "use 2", severity=WARNING, sources=("002", "001 §7.1.1"))
        if "model" in spec and r.traits.family == "gemma4" and not kv.startswith("fp8"):
            yield Hit("Gemma 4's paired MTP draft needs --kv-cache-dtype fp8 (NVFP4 KV breaks the draft)",
                      "add --kv-cache-dtype fp8", sources=("001 §7.2.3",))
    elif method == "dflash":
        if info is not None and info.vllm_at_least("0.21") is False:
            yield Hit(f"DFlash needs vLLM >= 0.21; {r.image} has {info.vllm}", "use vllm/vllm-openai:nightly or a "
                      "DFlash image", sources=("001 §14.5 Note",))
        if launch.env_value("VLLM_USE_DEEP_GEMM") != "0":
            yield Hit("DFlash without VLLM_USE_DEEP_GEMM=0: DeepGEMM is incompatible with the draft path (silent failure)",
                      "set env VLLM_USE_DEEP_GEMM=0")
        backend = launch.value("--attention-backend")
        if backend != "triton_attn":
            yield Hit(f"DFlash target with attention backend {backend or 'auto'}: flash_attn/FlashInfer crash on GB10",
                      "add --attention-backend triton_attn")
        if kv.startswith("fp8"):
            yield Hit("DFlash with --kv-cache-dtype fp8: the KV cache must stay BF16", "remove --kv-cache-dtype")
        if isinstance(n, int) and not 7 <= n <= 16:
            yield Hit(f"DFlash with num_speculative_tokens {n}: it verifies a whole block per pass (7-15 is normal)",
                      "use 7-15 (the drafter's block size)", severity=WARNING)
        if "attention_backend" in spec:
            yield Hit("attention_backend inside the speculative config: leave the drafter's backend at default",
                      "remove it from --speculative-config", severity=WARNING, sources=("001 §14.4 Tip",))
        features = set(info.features) if info else set()
        quantized = r.traits.fp4 or r.traits.quant in ("fp8", "gptq-int4")
        if quantized and "dflash-quantized" not in features:
            yield Hit(f"DFlash on a quantized target under stock vLLM ({r.image}): acceptance collapses after the "
                      "first few tokens", "use a DFlash-capable sm121 build (ghcr.io/aeon-7/...) or a BF16 target",
                      severity=WARNING, sources=("001 §7.1.1 Tip",))
        for x in r.extra_repos:
            missing = [f for f in x.requires_image_features if f not in features]
            if missing:
                yield Hit(f"drafter {x.repo} needs an image with {', '.join(missing)} support", "use an image that "
                          "has it (e.g. ghcr.io/aeon-7/aeon-vllm-ultimate) and list it in features",
                          severity=WARNING, sources=(_cite(x.source) if x.source else r.source.cite(),))


@rule("G30", WARNING, "FP8 KV cache is model-specific", "001 §8", "001 §14.7")
def g30_kv_fp8(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    if not (launch.value("--kv-cache-dtype") or "").lower().startswith("fp8"):
        return
    r = launch.recipe
    if r.traits.kv_fp8 == "broken":
        yield Hit("FP8 KV cache on a model whose FP8-KV output is scrambled on non-Hopper GPUs (Spark included)",
                  "remove --kv-cache-dtype fp8", severity=ERROR, sources=(r.source_of("traits.kv_fp8").cite(),))
    elif r.traits.kv_fp8 == "avoid":
        yield Hit(f"FP8 KV cache on {r.traits.family}: {r.source.cite()} uses it, {r.source_of('traits.kv_fp8').cite()} "
                  "says this family does not (repetition loops)", "remove --kv-cache-dtype fp8 if output loops",
                  sources=(r.source.cite(), r.source_of("traits.kv_fp8").cite()))


def _loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@rule("G31", ERROR, "no open port without an API key; keys never in argv or env", "001 §14.4", "001 §11")
def g31_api_key(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    ctx = launch.ctx
    if not _loopback(ctx.bind_host) and not ctx.api_key_file:
        yield Hit(f"binds {ctx.bind_host}:{ctx.port} with no API key: anyone on the LAN can use the model",
                  "set api_key_file for the host (a persistent 0600 key) or serve_bind: 127.0.0.1")
    if "VLLM_API_KEY" in launch.recipe.env:
        yield Hit("the recipe puts VLLM_API_KEY in env, where `docker inspect` shows it",
                  "remove it: sparkprov passes the host's key file")


# ---------------------------------------------------------------- multi-node

@rule("G32", ERROR, "NCCL over the QSFP link", "001 §13")
def g32_fabric(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    if launch.tp <= 1 or not launch.ctx.host_known:
        return
    if not launch.ctx.fabric_ifaces:
        yield Hit(f"TP={launch.tp} with no fabric interface for {launch.ctx.host}: NCCL falls back to Ethernet "
                  "(10-20x slower)", "set fabric_ifaces (e.g. enp1s0f1np1) in the host's vars")
    if not launch.ctx.node_ip:
        yield Hit(f"TP={launch.tp} with no fabric address for {launch.ctx.host} (VLLM_HOST_IP)",
                  "set fabric_ip in the host's vars", severity=WARNING)


@rule("G34", WARNING, "same weights and image on every node", "001 §13")
def g34_same_everywhere(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    info = launch.image_info
    if launch.tp > 1 and "@" not in launch.image and (info is None or info.moving):
        yield Hit(f"{launch.recipe.image} is a moving tag: two nodes can pull different builds",
                  "pin a digest (images: digest: sha256:...) for multi-node runs", sources=("001 §13", "001 §6"))


@rule("G35", ERROR, "TP x PP x DP = nodes x GPUs per node, and a TP the model supports", "001 §13", "004")
def g35_tp(launch: Launch, lc: LintContext) -> Iterator[Hit]:
    r = launch.recipe
    if launch.tp not in r.tp_sizes:
        yield Hit(f"TP={launch.tp} is not a size this recipe supports ({', '.join(map(str, r.tp_sizes))})",
                  f"use --tp {r.tp_sizes[0]}", sources=(r.source_of("tp_sizes").cite(),))
    n = launch.ctx.cluster_size
    pp = _int(launch.value("--pipeline-parallel-size")) or 1
    dp = _int(launch.value("--data-parallel-size")) or 1
    gpus = launch.tp * pp * dp  # the deployment's GPUs: tp x pp x dp
    if n is not None and n * GPUS_PER_SPARK != gpus:
        size = (f"TP={launch.tp}" + (f" x PP={pp}" if pp > 1 else "") + (f" x DP={dp}" if dp > 1 else "")
                + (f" = {gpus} GPUs" if gpus != launch.tp else ""))
        rest = " ".join([f"--pp {pp}"] * (pp > 1) + [f"--dp {dp}"] * (dp > 1))
        fixes = [f"--tp {n // (pp * dp)}" + (f" {rest}" if rest else "") if n % (pp * dp) == 0 else None,
                 f"--tp {launch.tp} --pp {n // launch.tp}" if n % launch.tp == 0 and n // launch.tp != pp else None]
        fix = " or ".join(f for f in fixes if f) or "change the cluster"
        yield Hit(f"{size} but the cluster has {n} node(s) x {GPUS_PER_SPARK} GPU = {n * GPUS_PER_SPARK} GPUs "
                  "(TP x PP x DP must equal them)",
                  f"use {fix}" + (" or change the cluster" if fix != "change the cluster" else ""))
    info = launch.image_info
    backend = launch.value("--distributed-executor-backend")
    if launch.has("--nnodes") and info is not None and info.native_multinode is False:
        yield Hit(f"vLLM's native multi-node executor on {launch.recipe.image} (vLLM {info.vllm}), which predates "
                  "--nnodes/--node-rank/--master-addr", "use an image with vLLM >= 0.12, or the ray executor",
                  sources=("vllm-project/vllm#23691",))
    # (cluster-up runs such a deployment on an image it derived with Ray baked in: no finding there)
    if gpus > 1 and backend == "ray" and info is not None and info.has_ray is False \
            and not launch.image.startswith(RAY_DERIVED_PREFIX):
        native = "native" in info.executors
        yield Hit(f"the Ray executor on {launch.recipe.image}, which ships no Ray: a Ray head started in it exits "
                  "127 ('ray: command not found'), and installing Ray at every start needs the network",
                  "cluster-up bakes Ray into a derived image once (no install at start), or use vLLM's native "
                  "multi-node executor (--executor native)" if native else
                  "cluster-up bakes Ray into a derived image once (no install at start)", severity=WARNING,
                  sources=("001 §6 image table", "vllm-project/vllm#33445"))


# ---------------------------------------------------------------- running the rules

def lint_launch(launch: Launch, *, catalog: Catalog, colocated: Iterable[Launch] = (),
                only: Iterable[str] | None = None, flags_cache: str | None = None,
                image_digest: str | None = None, pinned: bool = False) -> list[Finding]:
    """Every rule over one launch. Warnings named in the recipe's lint_ignore come back silenced.
    `flags_cache`: the directory of cached `vllm serve --help=all` answers (knownflags.write_cache);
    `image_digest`: the digest the host resolved the image to, to find its cached answer; `pinned`:
    the deployment runs by digest (cluster-up --pin), whatever tag its image names (G4)."""
    lc = LintContext(catalog=catalog, colocated=tuple(colocated), flags_cache=flags_cache,
                     image_digest=image_digest, pinned=pinned)
    wanted = set(only) if only is not None else None
    ignores = {i.rule: i.reason for i in launch.recipe.lint_ignore}
    out: list[Finding] = []
    for rid, r in RULES.items():
        if wanted is not None and rid not in wanted:
            continue
        for hit in r.check(launch, lc):
            sev = hit.severity or r.severity
            f = Finding(rule=rid, severity=sev, alias=launch.alias, message=hit.message, fix=hit.fix,
                        sources=hit.sources or r.sources)
            if rid in ignores and sev == WARNING:
                f = replace(f, silenced=ignores[rid])
            out.append(f)
    return out


def lint_cluster(launches: list[Launch]) -> list[Finding]:
    """G34 across the nodes of one TP group: same image, same store path, same model and flags."""
    out: list[Finding] = []
    if len(launches) < 2:
        return out
    first = launches[0]

    def key(l: Launch):
        return [(a.flag, a.value) for a in l.vllm_args if a.origin != "host"]

    for other in launches[1:]:
        for what, a, b in (("image", first.image, other.image),
                           ("model store", first.ctx.model_store, other.ctx.model_store),
                           ("recipe", first.alias, other.alias),
                           ("vLLM arguments", key(first), key(other))):
            if a != b:
                out.append(Finding(rule="G34", severity=ERROR, alias=first.alias,
                                   message=f"{what} differs between {first.ctx.host} and {other.ctx.host}",
                                   fix="render every node from the same recipe, image and store path",
                                   sources=("001 §13",)))
    return out


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == ERROR]

