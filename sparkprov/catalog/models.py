"""The catalog's data model: images and model recipes, every value with the note it came from.

A recipe file (the package's recipes/*.yaml or a user's file) holds:

    images:  [{ref, entrypoint, vllm, gb10, moving, min_driver, digest, source, notes}]
    recipes: [{alias, extends?, source, model, image, args, env, ...}]

`source` on a recipe is the default source of its values; a single value can carry its own
(`{flag: --x, value: 1, source: "002 unit file"}`, `env: {K: {value: v, source: ...}}`, or
`sources: {"traits.kv_fp8": "001 §7.3.1: ..."}` for any other field).
A source is "NOTE SECTION: quote" where NOTE is a seed note id (000..004), `sparkprov` (a value
sparkprov chose, with the reason) or `user` (filled in for user files).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from sparkprov.imageref import ImageRef

ALIAS_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")  # \Z: `$` would let a trailing newline through
# A Hugging Face repo id: NAME or ORG/NAME (letters, digits, . _ -; no '..'). It becomes a path
# under the store (models--ORG--NAME) and the argument of `vllm serve`, so nothing else is one.
REPO_ID_RE = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?\Z")
# A hub revision: a branch, a tag, refs/pr/N or a commit id.
REVISION_RE = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._/-]{0,255}(?<!/)\Z")
RULE_RE = re.compile(r"^G\d{1,2}$")
_SOURCE_RE = re.compile(r"^\s*(?P<note>[A-Za-z0-9_./-]+)(?:\s+(?P<where>[^:]*?))?\s*(?::\s*(?P<quote>.*))?$", re.S)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Source(Strict):
    """Where a value came from: a seed note id and a section or short quote."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    note: str
    where: str = ""
    quote: str = ""

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, v: Any) -> Any:
        if isinstance(v, str):
            m = _SOURCE_RE.match(v)
            if not m:
                raise ValueError("a source is 'NOTE SECTION: quote', e.g. '001 §7.1.1: --moe-backend marlin'")
            return {"note": m["note"], "where": (m["where"] or "").strip(), "quote": (m["quote"] or "").strip()}
        return v

    def cite(self) -> str:
        """Short form for one-line output: `001 §7.1.1`."""
        return f"{self.note} {self.where}".strip()

    def __str__(self) -> str:
        return self.cite() + (f": {self.quote}" if self.quote else "")


SCALAR = str | int | float | bool
FlagValue = SCALAR | dict | list | None


def render_value(v: FlagValue) -> str | None:
    """A flag value as vLLM gets it on the command line (JSON compact, like the notes write it)."""
    if v is None or v is True:
        return None
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1000:
        return str(int(v))
    return str(v)


class Flag(Strict):
    """One vLLM command-line flag. `value` None/true: a bare switch. `equals`: `--flag=value`."""

    flag: str
    value: FlagValue = None
    equals: bool = False
    source: Source | None = None

    @model_validator(mode="before")
    @classmethod
    def _compact(cls, v: Any) -> Any:
        if isinstance(v, str):
            if "=" in v and v.startswith("--"):
                name, _, value = v.partition("=")
                return {"flag": name, "value": value, "equals": True}
            return {"flag": v}
        if isinstance(v, dict) and len(v) == 1:
            (k, val), = v.items()
            if isinstance(k, str) and k.startswith("--"):
                return {"flag": k, "value": val}
        return v

    @field_validator("flag")
    @classmethod
    def _flag(cls, v: str) -> str:
        if not re.fullmatch(r"--[a-z0-9][a-z0-9-]*", v):
            raise ValueError(f"{v!r} is not a long option (like --max-model-len)")
        return v

    def argv(self) -> list[str]:
        text = render_value(self.value)
        if text is None:
            return [self.flag]
        return [f"{self.flag}={text}"] if self.equals else [self.flag, text]


class EnvValue(Strict):
    value: str
    source: Source | None = None

    @model_validator(mode="before")
    @classmethod
    def _compact(cls, v: Any) -> Any:
        if isinstance(v, (str, int, float)) and not isinstance(v, bool):
            return {"value": str(v)}
        if isinstance(v, dict) and "value" in v and not isinstance(v["value"], str):
            return {**v, "value": str(v["value"])}
        return v


def _path_words(v: str, what: str) -> list[str]:
    """The parts of a path that becomes one word of `docker run -v HOST:CONTAINER[:ro]`: a ':'
    would add mount options or a second path, a control character or '..' would leave where the
    recipe says it points."""
    if any(not c.isprintable() for c in v) or ":" in v or "," in v:
        raise ValueError(f"the {what} path holds ':', ',' or a control character")
    parts = v.split("/")
    if ".." in parts:
        raise ValueError(f"the {what} path may not use '..'")
    return parts


class Mount(Strict):
    """An extra bind mount. `host` is absolute, or relative to the model store, and may start with
    {model_store} or {model_dir}; never '..'. In a user file a mount is read-only unless it says
    `read_only: false` (load.py)."""

    host: str
    container: str
    read_only: bool = False
    purpose: str = ""
    source: Source | None = None

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        _path_words(v, "host")
        rest = re.sub(r"^\{(model_store|model_dir)\}(?=/|$)", "", v)
        if "{" in rest or "}" in rest:
            raise ValueError("the host path may start with {model_store} or {model_dir}, and use no other {...}")
        if not v.strip():
            raise ValueError("the host path is empty")
        return v

    @field_validator("container")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("the container path must be absolute")
        _path_words(v, "container")
        return v


def _repo_id(v: str) -> str:
    if not REPO_ID_RE.match(v):
        raise ValueError(f"{v[:80]!r} is not a Hugging Face repo id (ORG/NAME: letters, digits, '.', '_', '-')")
    return v


def _revision(v: str) -> str:
    if not REVISION_RE.match(v):
        raise ValueError(f"{v[:80]!r} is not a branch, tag or commit")
    return v


# A repo becomes a path in every host's store and the argument of `vllm serve`: `../../etc/passwd`
# would be served (and staged) from outside the store.
RepoId = Annotated[str, AfterValidator(_repo_id)]
Revision = Annotated[str, AfterValidator(_revision)]


class StageFile(Strict):
    """A file to put in the model store before launch (e.g. a reasoning-parser plugin)."""

    repo: RepoId
    filename: str
    revision: Revision = "main"
    dest: str  # relative to the model store
    purpose: str = ""
    source: Source | None = None

    @field_validator("dest")
    @classmethod
    def _rel(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/"):
            raise ValueError("dest is relative to the model store, without '..'")
        return v


class ExtraRepo(Strict):
    """Another repo the launch reads from the store: a drafter, a tokenizer."""

    repo: RepoId
    revision: Revision = "main"
    purpose: Literal["drafter", "tokenizer", "assistant"]
    size_gb: float | None = None
    gated: bool = False
    requires_image_features: list[Literal["dflash-quantized", "interleaved-swa"]] = Field(default_factory=list)
    source: Source | None = None


class ModelConfig(Strict):
    """The config.json values sparkprov needs: the KV cache of each layer kind (memory.py's
    `KvShape`), and a plausible fake config in the lab. `attention_layers` counts the layers with
    full attention only; sliding-window, linear-attention (Gated DeltaNet) and Mamba-2 layers are
    counted apart, with the dimensions their cache takes. A hybrid whose state dimensions are not
    recorded has no KV figure (None) rather than an attention-only one."""

    model_type: str
    architectures: list[str]
    num_hidden_layers: int
    attention_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    max_position_embeddings: int | None = None
    quant_method: str | None = None
    torch_dtype: str = "bfloat16"
    # sliding-window attention layers (same KV heads and head dim), keeping `sliding_window` tokens
    sliding_window_layers: int | None = Field(default=None, ge=1)
    sliding_window: int | None = Field(default=None, ge=1)
    # Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5/3.6): config.json's linear_* keys
    linear_attention_layers: int | None = Field(default=None, ge=1)
    linear_conv_kernel_dim: int | None = Field(default=None, ge=1)
    linear_num_key_heads: int | None = Field(default=None, ge=1)
    linear_key_head_dim: int | None = Field(default=None, ge=1)
    linear_num_value_heads: int | None = Field(default=None, ge=1)
    linear_value_head_dim: int | None = Field(default=None, ge=1)
    # Mamba-2 layers (Nemotron-H): config.json's mamba_*/ssm_* keys
    mamba_layers: int | None = Field(default=None, ge=1)
    mamba_num_heads: int | None = Field(default=None, ge=1)
    mamba_head_dim: int | None = Field(default=None, ge=1)
    mamba_n_groups: int | None = Field(default=None, ge=1)
    ssm_state_size: int | None = Field(default=None, ge=1)
    conv_kernel: int | None = Field(default=None, ge=1)
    # the recurrent state's dtype (config.json mamba_ssm_dtype / mamba_ssm_cache_dtype); unset:
    # vLLM's default, the model dtype
    mamba_ssm_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # full-attention layers of the checkpoint's own MTP head (mtp_num_hidden_layers), which keep a
    # KV cache when the launch speculates with method mtp
    mtp_layers: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _complete_kinds(self) -> "ModelConfig":
        parts = {
            "linear_attention_layers": ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_key_head_dim",
                                        "linear_num_value_heads", "linear_value_head_dim"),
            "mamba_layers": ("mamba_num_heads", "mamba_head_dim", "mamba_n_groups", "ssm_state_size", "conv_kernel"),
            "sliding_window_layers": ("sliding_window",),
        }
        for kind, needs in parts.items():
            if getattr(self, kind) is not None:
                missing = [n for n in needs if getattr(self, n) is None]
                if missing:
                    raise ValueError(f"{kind} needs {', '.join(missing)} (from the model's config.json)")
        return self

    @property
    def state_layers_known(self) -> bool:
        return self.linear_attention_layers is not None or self.mamba_layers is not None

    def hf_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architectures": list(self.architectures), "model_type": self.model_type,
                               "num_hidden_layers": self.num_hidden_layers, "torch_dtype": self.torch_dtype}
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                    "max_position_embeddings"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.quant_method:
            out["quantization_config"] = {"quant_method": self.quant_method}
        return out


class KvMeasured(Strict):
    """A startup log line from a note: the pool vLLM reported for this model. `pool_gib` may be
    missing where the note gives only the token count (002: "gives 1.6M token KV cache")."""

    kv_cache_dtype: str
    gpu_memory_utilization: float
    pool_gib: float | None = None
    pool_tokens: int
    weights_gib: float | None = None
    max_model_len: int | None = None
    source: Source | None = None

    @property
    def bytes_per_token(self) -> float | None:
        return None if self.pool_gib is None else self.pool_gib * 1024**3 / self.pool_tokens


class ModelRef(Strict):
    """What is served. `repo` is staged into the HF cache (HF_HOME = model store) unless `local_dir`
    is set (hf download --local-dir STORE/local_dir); then `path` is where the recipe mounts it."""

    repo: RepoId
    revision: Revision = "main"
    local_dir: str | None = None
    path: str | None = None  # container path passed to vLLM instead of the repo id
    arg: Literal["positional", "flag"] = "positional"  # accepted for old files; always rendered positional (--model is deprecated)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("model.path is a container path: absolute")
        if v is not None:
            _path_words(v, "model")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ModelRef":
        if self.path and not self.local_dir:
            raise ValueError("model.path needs model.local_dir (what is mounted there)")
        if self.local_dir and (self.local_dir.startswith("/") or ".." in self.local_dir.split("/")):
            raise ValueError("model.local_dir is relative to the model store")
        return self

    @property
    def served_ref(self) -> str:
        return self.path or self.repo


class Traits(Strict):
    family: str
    moe: bool = False
    ssm_layers: list[Literal["gated_deltanet", "mamba2"]] = Field(default_factory=list)
    # awq / unknown: imported recipes whose checkpoint format sparkprov cannot tell (G6 stays quiet)
    quant: Literal["nvfp4-modelopt", "nvfp4-ct", "fp8", "fp8-runtime", "mxfp4", "gptq-int4", "bf16", "awq", "unknown"]
    mtp_heads: bool = False
    multimodal: bool = False
    thinking: Literal["on", "off", "none"] = "none"  # default thinking mode of the chat template
    tool_parsers: list[str] = Field(default_factory=list)  # parsers matching the model's output format
    kv_fp8: Literal["ok", "avoid", "broken", "unknown"] = "unknown"
    card_disables_prefix_caching: bool = False
    mamba_align_block_size: int | None = None
    native_max_len: int | None = None

    @property
    def hybrid(self) -> bool:
        return bool(self.ssm_layers)

    @property
    def fp4(self) -> bool:
        return self.quant in ("nvfp4-modelopt", "nvfp4-ct", "mxfp4")


class DockerOpts(Strict):
    """Options of `docker run`, each one word of its argv: checked by type, since a value such as
    "1g --privileged" would reach the daemon as a size it refuses at start, on every host."""

    shm_size: str | None = None
    ulimits: list[str] = Field(default_factory=list)

    @field_validator("shm_size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[1-9][0-9]{0,12}(\.[0-9]+)?([bkmgBKMG][bB]?)?", v):
            raise ValueError(f"shm_size {v[:40]!r} is not a size (a number with b, k, m or g: 16gb, 64g)")
        return v

    @field_validator("ulimits")
    @classmethod
    def _ulimits(cls, v: list[str]) -> list[str]:
        for u in v:
            if not re.fullmatch(r"[a-z]+=-?[0-9]{1,20}(:-?[0-9]{1,20})?", u):
                raise ValueError(f"ulimit {u[:40]!r} is not NAME=SOFT[:HARD] (memlock=-1, stack=67108864)")
        return v
    ipc: Literal["host", "private", "shareable"] = "host"
    restart: Literal["no", "always", "unless-stopped", "on-failure"] = "unless-stopped"


class Startup(Strict):
    """How long the serve step waits for /health, and whether it sends a warm-up request (G20)."""

    health_timeout_s: int = 900
    warmup: bool = True
    source: Source | None = None


class SmokeSpec(Strict):
    """What the smoke test sends and expects (G8: degenerate output, G28: thinking)."""

    prompt: str = "12*17"
    expect: str | None = "204"
    max_tokens: int = 500
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    reject_degenerate: bool = True

    def check(self, text: str | None) -> list[str]:
        """Problems with a reply; empty = good."""
        problems: list[str] = []
        body = (text or "").strip()
        if self.reject_degenerate:
            reason = degenerate(body)
            if reason:
                problems.append(f"G8: {reason} (an sm_121 FP4 kernel problem, not the prompt: use the Marlin path)")
        if self.expect is not None and self.expect not in body:
            problems.append(f"expected {self.expect!r} in the reply")
        return problems


def degenerate(text: str) -> str | None:
    """Why a reply looks like the sm_121 FP4 failure of G8 ("!!!!!" or empty), or None."""
    if not text:
        return "empty reply"
    compact = re.sub(r"\s+", "", text)
    if len(compact) >= 4 and len(set(compact)) == 1:
        return f"reply is one repeated character ({compact[0]!r} x{len(compact)})"
    return None


class LintIgnore(Strict):
    rule: str
    reason: str

    @field_validator("rule")
    @classmethod
    def _rule(cls, v: str) -> str:
        if not RULE_RE.match(v):
            raise ValueError(f"{v!r} is not a rule id (G1..G36)")
        return v

    @field_validator("reason")
    @classmethod
    def _reason(cls, v: str) -> str:
        if len(v.strip()) < 5:
            raise ValueError("say why the warning does not apply (a reason of a few words)")
        return v


class Correction(Strict):
    """A documented difference between the note's command and what sparkprov renders."""

    what: str  # e.g. "drop env VLLM_USE_FLASHINFER_MOE", "image", "add --moe-backend marlin"
    note_value: str | None = None
    value: str | None = None
    reason: str
    source: Source | None = None


class NoteCommand(Strict):
    """The note's launch command verbatim (tests compare the rendering with it)."""

    text: str
    source: Source | None = None


# vLLM's own multi-node launch (`--nnodes/--node-rank/--master-addr/--master-port/--headless`, the
# multiprocessing executor across nodes) came with vllm-project/vllm#23691, merged 2025-11-14; the
# first release cut after it is v0.12.0 (counted from there, conservatively).
NATIVE_MULTINODE_SINCE = "0.12.0"
# Ray became optional in vLLM (vllm-project/vllm#33445, #33351): stock vllm/vllm-openai images ship
# no Ray since v0.19; NGC's vLLM images ship none (001 §6: the cluster scripts pip install it).
STOCK_RAY_DROPPED = "0.19.0"
UNPINNED = "unpinned"
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


class Image(Strict):
    """A container image and what sparkprov knows about it (G1-G5)."""

    ref: str  # repo:tag
    # sha256:... where a source gives one; `unpinned` says explicitly that none is known (G4 warns)
    digest: str | None = None
    digest_source: Source | None = None  # where the digest came from (a note, `invoke images --pin`)
    ray: bool | None = None  # ships Ray; None: derived (stock < 0.19: yes; NGC, stock >= 0.19: no)
    entrypoint: Literal["vllm-serve", "passthrough", "custom"]
    vllm: str | None = None  # vLLM version it carries, where known ("0.19.0", "0.23")
    gb10: bool | None = None  # True: known to run on sm_121; False: known not to; None: unknown
    moving: bool = False  # the tag moves (nightly/latest): pin a digest (G4)
    min_driver: str | None = None
    features: list[Literal["dflash-quantized", "interleaved-swa"]] = Field(default_factory=list)
    flags: str | None = None  # recorded serve-option set (sparkprov/catalog/flags/NAME.txt); default: by vllm
    # "cpu": a CPU build of vLLM (the lab's real engine): no GPU kernels; its KV cache is sized by
    # VLLM_CPU_KVCACHE_SPACE, else by --gpu-memory-utilization of the host's RAM (docs/real-vllm.md)
    device: Literal["gpu", "cpu"] = "gpu"
    source: Source
    notes: str = ""

    @field_validator("flags")
    @classmethod
    def _flags(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", v):
            raise ValueError("flags names a recorded set such as vllm-0.19 or mxfp4-community")
        return v

    @field_validator("vllm")
    @classmethod
    def _vllm(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"(>=|<)?\d+(\.\d+){0,2}", v):
            raise ValueError("vllm is a version (0.19.0), a floor (>=0.21) or a ceiling (<0.15.1)")
        return v

    def vllm_at_least(self, version: str) -> bool | None:
        """Whether the image's vLLM is >= `version`; None when the catalog cannot tell."""
        if self.vllm is None:
            return None
        want = _ver(version)
        if self.vllm.startswith(">="):
            return True if _ver(self.vllm[2:]) >= want else None
        if self.vllm.startswith("<"):
            return False if _ver(self.vllm[1:]) <= want else None
        return _ver(self.vllm) >= want

    @field_validator("ref")
    @classmethod
    def _ref(cls, v: str) -> str:
        ref = ImageRef.parse(v)
        if ref.digest is not None or ref.tag is None:
            raise ValueError("ref is repo:tag (put a digest in `digest:`)")
        return v

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and v != UNPINNED and not DIGEST_RE.match(v):
            raise ValueError("digest is sha256:<64 hex digits>, or `unpinned` where no source gives one")
        return v

    @property
    def is_pinned(self) -> bool:
        return self.digest is not None and self.digest != UNPINNED

    @property
    def pinned(self) -> str:
        """repo:tag@sha256:... when pinned, else repo:tag."""
        return f"{self.ref}@{self.digest}" if self.is_pinned else self.ref

    @property
    def repo(self) -> str:
        return ImageRef.parse(self.ref).name

    @property
    def vllm_version(self) -> str | None:
        """The vLLM version it carries ("0.19.0"), a floor (">=0.21"), a ceiling ("<0.15.1") or None."""
        return self.vllm

    @property
    def has_ray(self) -> bool | None:
        """Whether the image ships Ray (`ray` in the catalog, else derived; None: unknown)."""
        if self.ray is not None:
            return self.ray
        if self.repo == "nvcr.io/nvidia/vllm":
            return False
        if self.repo in ("vllm/vllm-openai", "docker.io/vllm/vllm-openai"):
            newer = self.vllm_at_least(STOCK_RAY_DROPPED)
            return None if newer is None else not newer
        return None

    @property
    def native_multinode(self) -> bool | None:
        """Whether its vLLM has `--nnodes/--node-rank/--master-addr/--master-port/--headless`."""
        return self.vllm_at_least(NATIVE_MULTINODE_SINCE)

    @property
    def executors(self) -> tuple[str, ...]:
        """The multi-node executors it can run: `native` (vLLM's own) and/or `ray`. Only what the
        catalog knows: an image whose vLLM or Ray is unknown lists neither for that part."""
        out: list[str] = []
        if self.native_multinode:
            out.append("native")
        if self.has_ray:
            out.append("ray")
        return tuple(out)


def _ver(text: str) -> tuple[int, ...]:
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


class Recipe(Strict):
    """A model recipe as written in a file (fields optional where `extends` can supply them)."""

    alias: str
    extends: str | None = None
    title: str | None = None
    source: Source | None = None
    sources: dict[str, Source] = Field(default_factory=dict)
    model: dict[str, Any] | None = None  # ModelRef; validated after `extends` is applied
    size_gb: float | None = None
    gated: bool | None = None
    traits: dict[str, Any] | None = None  # Traits
    config: dict[str, Any] | None = None  # ModelConfig
    kv_measured: dict[str, Any] | None = None  # KvMeasured
    image: str | None = None
    command: Literal["bare", "full"] | None = None  # how the image takes vllm serve (G2); default: the image's
    pre_serve: list[list[str]] | None = None  # commands run in the container before vllm serve (argv lists)
    env: dict[str, EnvValue] | None = None
    remove_env: list[str] = Field(default_factory=list)
    args: list[Flag] | None = None
    add_args: list[Flag] = Field(default_factory=list)
    remove_args: list[str] = Field(default_factory=list)
    docker: dict[str, Any] | None = None  # DockerOpts
    mounts: list[Mount] | None = None
    stage: list[StageFile] | None = None
    extra_repos: list[ExtraRepo] | None = None
    tp_sizes: list[int] | None = None
    startup: dict[str, Any] | None = None  # Startup
    smoke: dict[str, Any] | None = None  # SmokeSpec
    lint_ignore: list[LintIgnore] = Field(default_factory=list)
    note_command: NoteCommand | None = None
    corrections: list[Correction] | None = None
    notes: list[str] | None = None

    @field_validator("alias", "extends")
    @classmethod
    def _alias(cls, v: str | None) -> str | None:
        if v is not None and not ALIAS_RE.match(v):
            raise ValueError(f"{v!r} is not a valid alias (lowercase letters, digits, '.', '_', '-')")
        if v == "all":
            raise ValueError("'all' is reserved (invoke lint all)")
        return v

    @field_validator("tp_sizes")
    @classmethod
    def _tp(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(n < 1 for n in v)):
            raise ValueError("tp_sizes lists positive integers")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict | None) -> dict | None:
        for k in v or {}:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{k!r} is not an environment variable name")
        return v

    @field_validator("pre_serve")
    @classmethod
    def _pre(cls, v: list[list[str]] | None) -> list[list[str]] | None:
        if v is not None and any(not cmd for cmd in v):
            raise ValueError("each pre_serve entry is a non-empty argv list")
        return v


NESTED = {"model": ModelRef, "traits": Traits, "config": ModelConfig, "kv_measured": KvMeasured,
          "docker": DockerOpts, "startup": Startup, "smoke": SmokeSpec}
REQUIRED = ("source", "model", "gated", "traits", "image", "args", "tp_sizes")


class ResolvedRecipe(Strict):
    """A recipe with `extends` applied and every value present (what rendering and linting use)."""

    alias: str
    extends: str | None = None
    title: str
    origin: str  # file it was defined in
    source: Source
    sources: dict[str, Source]
    model: ModelRef
    size_gb: float | None
    gated: bool
    traits: Traits
    config: ModelConfig | None
    kv_measured: KvMeasured | None
    image: str
    command: Literal["bare", "full"] | None
    pre_serve: list[list[str]]
    env: dict[str, EnvValue]
    args: list[Flag]
    docker: DockerOpts
    mounts: list[Mount]
    stage: list[StageFile]
    extra_repos: list[ExtraRepo]
    tp_sizes: list[int]
    startup: Startup
    smoke: SmokeSpec
    lint_ignore: list[LintIgnore]
    note_command: NoteCommand | None
    corrections: list[Correction]
    notes: list[str]

    def source_of(self, path: str) -> Source:
        """The source of a field (dotted path: `size_gb`, `traits.kv_fp8`), or the recipe's."""
        p = path
        while p:
            if p in self.sources:
                return self.sources[p]
            p = p.rpartition(".")[0]
        return self.source

    def flag(self, name: str) -> Flag | None:
        for f in self.args:
            if f.flag == name:
                return f
        return None

    @property
    def speculative(self) -> dict | None:
        f = self.flag("--speculative-config")
        if f is None:
            return None
        if isinstance(f.value, dict):
            return f.value
        try:
            value = json.loads(str(f.value))
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
