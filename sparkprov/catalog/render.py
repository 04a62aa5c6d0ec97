"""Render a recipe into the parts of the container sparkprov would run on one host: its vLLM
arguments, environment, mounts and docker options (serving/spec.py assembles the `docker run` of
every role from them).

Everything a host contributes is in HostServeContext; everything the model needs is in the
recipe. The result, a Launch, keeps the source of every part, so `invoke recipe` can say where
each one came from and the linter can cite it.

House rules the rendering applies to every recipe (the notes' commands differ here; tests check
that these are the only differences besides each recipe's documented `corrections`):

* Host networking (`--network host`) and vLLM's own `--host/--port` from the host (the notes use
  `-p 8000:8000`): TP>1 needs NCCL/Gloo/Ray on the fabric interfaces of the host (G32), and the
  bind address is then what the API is exposed on (G31).
* The model store (HF_HOME) is mounted at the same path inside the container (G22), the vLLM
  compile cache at /root/.cache/vllm (001 §4), HF_HUB_OFFLINE=1 always (G24). HF_TOKEN is never
  passed to the serving container: weights are staged beforehand (G26 is the staging step's
  business), so the token stays out of `docker inspect`.
* The API key (G31). vLLM takes it from `--api-key` or from the VLLM_API_KEY environment variable.
  Either one written into the container's config shows in `docker inspect` (Args / Config.Env);
  `--api-key` expanded inside the container still lands in the vLLM process's argv, which
  /proc/PID/cmdline shows to every user on the host (`ps aux`). The least exposing way that works
  with stock vLLM: mount the host's 0600 key file read-only at /run/secrets/sparkprov_api_key and
  start vLLM through a fixed `sh -c` wrapper that reads the file into VLLM_API_KEY and `exec`s
  vllm serve. The key then exists only in the file and in the environment of the vLLM process
  (/proc/PID/environ is readable by its owner and root only), never in argv or the container
  config. The wrapper text is a constant; the model and flags follow it as separate argv words
  ("$@"), so no recipe value is ever parsed by a shell. The wrapper refuses to start vLLM if the
  file is missing or empty (an empty key would mean no authentication).
* NGC images keep their entrypoint (it sets up CUDA forward compatibility, G5): the wrapper is
  passed as the command. vllm/vllm-openai images get `--entrypoint sh` (their entrypoint is
  `vllm serve`, G2). Images with their own entrypoint (`custom`) always get the wrapper.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sparkprov.catalog.derive import ImageChoice, baked_requirements, choose_image, start_steps
from sparkprov.catalog.load import Catalog
from sparkprov.catalog.memory import HOST_MEMORY_GIB, MIN_HEADROOM_GIB
from sparkprov.catalog.models import Image, ResolvedRecipe, SmokeSpec, Source, Startup, render_value
from sparkprov import inventory_vars as iv
from sparkprov.defaults import API_KEY_FILE, COMPILE_CACHE, MODEL_STORE, SERVE_BIND, SERVE_PORT, expand_home
from sparkprov.errors import InputError
from sparkprov.imageref import ImageRef

KEY_PATH = "/run/secrets/sparkprov_api_key"
COMPILE_CACHE_IN_CONTAINER = "/root/.cache/vllm"
WRAPPER_NAME = "sparkprov-serve"  # $0 of the wrapper script

SRC_STORE = Source(note="001", where="§3", quote="-e HF_HOME=/models -v ~/vllm:/models (G22: same path inside)")
SRC_OFFLINE = Source(note="001", where="§3", quote="Force fully-local loading with -e HF_HUB_OFFLINE=1 (G24)")
SRC_COMPILE = Source(note="001", where="§4", quote="-v ~/vllm-compile-cache:/root/.cache/vllm")
SRC_BIND = Source(note="sparkprov", where="host vars serve_bind/serve_port", quote="G31")
SRC_TP = Source(note="001", where="§13", quote="--tensor-parallel-size = number of GPUs (G35)")
SRC_PP = Source(note="sparkprov", where="deployment pp", quote="tp x pp = the GPUs of the nodes, one per Spark (G35)")
SRC_DP = Source(note="sparkprov", where="deployment dp",
                quote="data-parallel replicas: tp x pp x dp = the GPUs of the nodes (G35); vLLM data_parallel_deployment")
SRC_EP = Source(note="sparkprov", where="deployment ep", quote="--enable-expert-parallel (MoE: experts split over tp x dp)")
SRC_RAY = Source(note="001", where="§13", quote="run a Ray cluster with --tensor-parallel-size = number of GPUs")
SRC_FABRIC = Source(note="001", where="§13", quote="Bind NCCL to the QSFP interface (G32); host vars")
SRC_OVERRIDE = Source(note="override", where="render_launch(overrides=...)")
# The NCCL settings a topology needs beyond a pair's and a switch's, each with its source (issue 34).
# On a ring or a mesh each cable twin is its own subnet and NCCL's sockets run over the management link
# (facts/fabric.py nccl_settings): NCCL must pick, per peer, the HCA on that peer's subnet.
_SRC_RING = Source(note="eugr/spark-vllm-docker", where="cluster_topology.py RING_ENV (a10c3f7)",
                   quote="rings of 4 or more: NCCL_ALGO=Ring, NCCL_NET_PLUGIN=none, NCCL_IB_SUBNET_AWARE_ROUTING=1, "
                         "NCCL_IB_MERGE_NICS=0")
_SRC_TREE = Source(note="MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks", where="PR#3",
                   quote="a 4-node ring has no direct fabric path between opposite nodes: NCCL's tree never connects")
_SRC_MESH = Source(note="defilantech/LLMKube", where="PR#1816 (three-Spark ring, TP 3)",
                   quote="NCCL_IB_SUBNET_AWARE_ROUTING=1: the one NCCL variable that makes a P0 to P1 ring work")
_SRC_SPARKRUN = Source(note="spark-arena/sparkrun", where="#157, #174 (3-node mesh, ring topology)",
                       quote="NCCL_IB_MERGE_NICS=0, NCCL_IB_SUBNET_AWARE_ROUTING=1 in the ring configuration")
TOPOLOGY_ENV: dict[str, tuple[tuple[str, str, Source], ...]] = {
    "ring": (("NCCL_IB_SUBNET_AWARE_ROUTING", "1", _SRC_RING), ("NCCL_IB_MERGE_NICS", "0", _SRC_RING),
             ("NCCL_ALGO", "Ring", _SRC_TREE), ("NCCL_NET_PLUGIN", "none", _SRC_RING)),
    "mesh": (("NCCL_IB_SUBNET_AWARE_ROUTING", "1", _SRC_MESH), ("NCCL_IB_MERGE_NICS", "0", _SRC_SPARKRUN)),
}
SRC_GPUS = Source(note="001", where="§3", quote="docker run --gpus all")
SRC_NETWORK = Source(note="sparkprov", where="host networking", quote="NCCL/Gloo/Ray on the fabric interfaces (G32)")
SRC_KEY = Source(note="001", where="§14.4", quote="make a PERSISTENT API key (G31); passed as a 0600 file")


# The API key file when the inventory sets no api_key_file: in the login user's home on the head,
# the same for `invoke recipe --host H` and `invoke cluster-up` (sparkprov.cluster.hosts uses it).
DEFAULT_API_KEY_FILE = API_KEY_FILE


class HostServeContext(BaseModel):
    """What a host contributes to a launch. Build it from inventory vars with `from_host_vars`."""

    model_config = ConfigDict(extra="forbid")

    host: str = "localhost"
    host_known: bool = False  # False: no host given; rules that need the host's facts stay silent
    # Without a host these are the shared defaults (sparkprov.defaults), `~/` meaning the login
    # user's home there; shell_command() writes them as "$HOME"/... so a pasted command works.
    model_store: str = MODEL_STORE
    compile_cache: str = COMPILE_CACHE
    bind_host: str = SERVE_BIND
    port: int = Field(default=SERVE_PORT, ge=1, le=65535)
    api_key_file: str | None = DEFAULT_API_KEY_FILE  # ~/: the login user's home (from_host_vars expands it)
    container_name: str | None = None  # default: sparkprov-ALIAS
    fabric_ifaces: list[str] = Field(default_factory=list)  # e.g. enp1s0f1np1,enP2p1s0f1np1
    ib_hcas: list[str] = Field(default_factory=list)  # e.g. rocep1s0f1,roceP2p1s0f1
    node_ip: str | None = None  # this node's fabric address (VLLM_HOST_IP)
    # the fabric's topology (facts/topology.py: recorded by provision, or fabric_topology): a mesh or
    # ring adds the NCCL settings it needs (TOPOLOGY_ENV); pair, switch and None add nothing
    fabric_topology: Literal["pair", "mesh", "ring", "switch"] | None = None
    utilization_cap: float | None = Field(default=None, gt=0, le=1)  # G18: modeset=0 cap from gpu_check
    cluster_size: int | None = Field(default=None, ge=1)  # nodes the deployment spans (tp x pp x dp, one GPU each)
    driver_version: str | None = None
    hf_token_available: bool | None = None  # None: not known here
    other_services_gib: float = 0.0
    host_memory_gib: float = HOST_MEMORY_GIB
    min_headroom_gib: float = MIN_HEADROOM_GIB

    @field_validator("model_store", "compile_cache", "api_key_file")
    @classmethod
    def _abs(cls, v: str | None, info) -> str | None:
        if info.field_name == "api_key_file" and v == DEFAULT_API_KEY_FILE:
            return v  # no host known: shown as the login user's ~ path
        if v is not None and v.startswith("~/") and not info.data.get("host_known"):
            return v.rstrip("/")  # no host known: the login user's home (shell_command() writes "$HOME")
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute path")
        return v.rstrip("/") or "/" if v else v

    VARS: ClassVar[dict[str, str]] = {  # inventory variable -> field
        "model_store": "model_store", "compile_cache": "compile_cache", "serve_bind": "bind_host",
        "serve_port": "port", "api_key_file": "api_key_file", "fabric_ifaces": "fabric_ifaces",
        "ib_hcas": "ib_hcas", "fabric_ip": "node_ip", "driver_version": "driver_version",
        "fabric_topology": "fabric_topology",
        "other_services_gib": "other_services_gib", "host_memory_gib": "host_memory_gib",
        "min_headroom_gib": "min_headroom_gib", "max_gpu_memory_utilization": "utilization_cap",
    }

    @classmethod
    def from_host_vars(cls, host: str, variables: Mapping[str, Any], *, home: str | None = None,
                       **extra: Any) -> "HostServeContext":
        """Build from a host's merged inventory vars (names in VARS; `hf_token_file` or
        `hf_token_env` set means a token is available for staging gated repos). Paths written
        as ~/x are under `home`, the login user's home on that host."""
        data: dict[str, Any] = {"host": host, "host_known": True}
        if "api_key_file" not in variables and home:
            data["api_key_file"] = expand_home(iv.default("api_key_file"), home)
        for var in ("model_store", "compile_cache"):  # unset: the shared default, in this host's home
            if variables.get(var) is None and home:
                data[var] = expand_home(iv.default(var), home)
        for var, fld in cls.VARS.items():
            if var in variables and variables[var] is not None:
                value = iv.value(variables, var)  # checked as declared; interface lists as lists
                if isinstance(value, str) and (value == "~" or value.startswith("~/")):
                    if not home:
                        raise InputError(f"{var}: {value!r} needs the login user's home on {host}",
                                         fix="give an absolute path")
                    value = home.rstrip("/") + value[1:]
                data[fld] = value
        if "api_key_file" in variables and (variables["api_key_file"] is None or not iv.value(variables, "api_key_file")):
            data["api_key_file"] = None
        if "hf_token_file" in variables or "hf_token_env" in variables:
            data["hf_token_available"] = bool(iv.value(variables, "hf_token_file")
                                              or iv.value(variables, "hf_token_env"))
        data.update(extra)
        return cls(**data)


Origin = Literal["recipe", "host", "tp", "override", "sparkprov"]


class Arg(BaseModel):
    """One vLLM argument: the model (flag None) or a flag with its value."""

    flag: str | None
    value: str | None = None
    equals: bool = False
    source: Source
    origin: Origin = "recipe"

    def argv(self) -> list[str]:
        if self.flag is None:
            return [self.value or ""]
        if self.value is None:
            return [self.flag]
        return [f"{self.flag}={self.value}"] if self.equals else [self.flag, self.value]


class EnvVar(BaseModel):
    name: str
    value: str
    source: Source
    origin: Origin = "recipe"


class LaunchMount(BaseModel):
    host: str
    container: str
    read_only: bool = False
    purpose: str = ""
    source: Source

    def spec(self) -> str:
        return f"{self.host}:{self.container}" + (":ro" if self.read_only else "")


class DockerOption(BaseModel):
    """One option of `docker run` (its words) and where it came from."""

    words: list[str]
    source: Source
    origin: Origin = "recipe"


class Launch(BaseModel):
    """A rendered recipe: its parts (vLLM arguments, environment, mounts, docker options, each with
    where it came from). serving/spec.py assembles a container of any role from them."""

    alias: str
    tp: int
    image: str
    pp: int = 1  # pipeline stages of the engine
    dp: int = 1  # data-parallel replicas (one Spark each)
    ep: bool = False  # expert parallelism
    image_info: Image | None
    command: Literal["bare", "full"]
    container_name: str
    env: list[EnvVar]
    vllm_args: list[Arg]
    mounts: list[LaunchMount]
    docker_options: list[DockerOption]
    recipe: ResolvedRecipe
    ctx: HostServeContext
    startup: Startup
    smoke: SmokeSpec

    @property
    def entrypoint_kind(self) -> str:
        return image_entrypoint(self.recipe.image, self.image_info)

    @property
    def wrapped(self) -> bool:
        """vLLM starts under sparkprov's sh wrapper: it reads the API key file, runs the recipe's
        pre_serve commands, or stands in for an image's own entrypoint."""
        return bool(self.ctx.api_key_file) or bool(self.start_steps) or self.entrypoint_kind == "custom"

    @property
    def start_steps(self) -> list[list[str]]:
        """The recipe's pre_serve commands the container runs before vllm serve: its plain pip
        installs are baked into the derived image it runs instead (catalog/derive.py)."""
        return start_steps(self.recipe.pre_serve)

    @property
    def baked(self) -> list[str]:
        """The recipe's pip requirements baked into the image derived from its own (none: it runs
        its image as it is)."""
        return baked_requirements(self.recipe.pre_serve)

    # ----- lookups the linter and the serve step use -----
    def arg(self, flag: str) -> Arg | None:
        for a in self.vllm_args:
            if a.flag == flag:
                return a
        return None

    def has(self, flag: str) -> bool:
        return self.arg(flag) is not None

    def value(self, flag: str) -> str | None:
        a = self.arg(flag)
        return a.value if a else None

    def number(self, flag: str) -> float | None:
        v = self.value(flag)
        try:
            return float(v) if v is not None else None
        except ValueError:
            return None

    def env_value(self, name: str) -> str | None:
        for e in self.env:
            if e.name == name:
                return e.value
        return None

    @property
    def model_arg(self) -> str:
        m = self.arg("--model")
        if m is not None:
            return m.value or ""
        return next((a.value or "" for a in self.vllm_args if a.flag is None), "")

    @property
    def served_model_name(self) -> str:
        return self.value("--served-model-name") or self.model_arg

    @property
    def speculative(self) -> dict | None:
        v = self.value("--speculative-config")
        if v is None:
            return None
        try:
            out = json.loads(v)
        except ValueError:
            return None
        return out if isinstance(out, dict) else None

    @property
    def vllm_argv(self) -> list[str]:
        return [w for a in self.vllm_args for w in a.argv()]



_HOME_RE = re.compile(r"(?:(?<=^)|(?<=[:=]))~(?=/)")


def shell_command(argv: list[str]) -> str:
    """A command for a person to read or paste (each word quoted). A path under the login user's
    home (`~/...`, rendered without a host) is written "$HOME"/... so that the shell expands it:
    docker refuses a literal `~` in `-v` and vLLM would take it literally."""
    return " ".join(_shell_word(w) for w in argv)


def _shell_word(word: str) -> str:
    parts = _HOME_RE.split(word)
    if len(parts) == 1:
        return shlex.quote(word)
    return '"$HOME"'.join(shlex.quote(p) if p else "" for p in parts)


def image_entrypoint(image: str, info: Image | None) -> str:
    """vllm-serve | passthrough | custom: the image's entrypoint kind (G2)."""
    if info is not None:
        return info.entrypoint
    repo = ImageRef.parse(image).name
    if repo in ("vllm/vllm-openai", "docker.io/vllm/vllm-openai"):
        return "vllm-serve"
    if repo == "nvcr.io/nvidia/vllm":
        return "passthrough"
    return "custom"


def _store_path(path: str, ctx: HostServeContext, recipe: ResolvedRecipe) -> str:
    """A recipe's host path with {model_store} and {model_dir} put in. Without a host the store is
    `~/vllm` (the login user's home): a path that then starts with `~/` is already whole; only a
    path relative to nothing is taken as under the store."""
    model_dir = f"{ctx.model_store}/{recipe.model.local_dir}" if recipe.model.local_dir else ctx.model_store
    out = path.replace("{model_store}", ctx.model_store).replace("{model_dir}", model_dir)
    if not out.startswith(("/", "~/")):
        out = f"{ctx.model_store}/{out}"
    return out


def render_launch(recipe: ResolvedRecipe, ctx: HostServeContext, tp: int = 1,
                  overrides: Mapping[str, Any] | None = None, *, catalog: Catalog | None = None,
                  pp: int = 1, dp: int = 1, ep: bool = False, image: ImageChoice | None = None) -> Launch:
    """The launch of `recipe` on the host described by `ctx`, with tensor parallelism `tp`,
    pipeline parallelism `pp`, `dp` data-parallel replicas, expert parallelism `ep` (the sizes:
    each rank's own options come from serving/spec.py) and flag `overrides` ({"--max-model-len":
    32768, "--enable-chunked-prefill": None (remove), "--enforce-eager": True (bare switch)}); an
    override may not set a size against the layout. A launch that spans nodes (tp x pp x dp > 1, or
    a ctx.cluster_size > 1) gets the fabric bindings of the node (VLLM_HOST_IP, NCCL/Gloo/UCX
    interfaces), and an engine over several GPUs its executor. `image`: the image its containers run
    (catalog/derive.py choose_image; default: the recipe's, as the catalog records it). Pure: nothing
    is run."""
    from sparkprov.catalog.layout import Layout, override_conflicts

    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        if value < 1:
            raise InputError(f"--{name} must be at least 1, got {value}", fix=f"use --{name} 1")
    conflict = override_conflicts(dict(overrides or {}), Layout(tp, pp, dp, ep))
    if conflict:
        raise InputError(f"override {conflict}", fix="set the layout with tp/pp/dp/ep, not an override")
    if catalog is None:
        from sparkprov.catalog.load import load_catalog

        catalog = load_catalog()
    info = catalog.image(recipe.image)
    runs = (image or choose_image(recipe, catalog)).runs
    kind = image_entrypoint(recipe.image, info)
    command = recipe.command or ("bare" if kind == "vllm-serve" else "full")
    args, pp = _vllm_args(recipe, ctx, overrides or {}, tp, pp, dp, ep)
    spans = tp * pp * dp > 1 or (ctx.cluster_size or 1) > 1  # the deployment spans nodes: fabric bindings
    return Launch(alias=recipe.alias, tp=tp, pp=pp, dp=dp, ep=ep, image=runs, image_info=info, command=command,
                  container_name=ctx.container_name or f"sparkprov-{recipe.alias}", env=_environment(recipe, ctx, spans),
                  vllm_args=args, mounts=_mounts(recipe, ctx), docker_options=_docker_options(recipe), recipe=recipe,
                  ctx=ctx, startup=recipe.startup, smoke=recipe.smoke)


def _vllm_args(recipe: ResolvedRecipe, ctx: HostServeContext, overrides: Mapping[str, Any], tp: int, pp: int, dp: int,
               ep: bool) -> tuple[list[Arg], int]:
    """vLLM's arguments, in the note's order: the model, the recipe's flags, the overrides, the
    layout's sizes and executor, the bind address; and the pipeline stages they give."""
    # Always positional (`vllm serve MODEL`): --model is deprecated for `vllm serve`.
    model_src = recipe.source_of("model")
    args: list[Arg] = [Arg(flag=None, value=recipe.model.served_ref, source=model_src)]
    for f in recipe.args:
        value = render_value(f.value)
        if value is not None:
            value = value.replace("{model_store}", ctx.model_store)
        args.append(Arg(flag=f.flag, value=value, equals=f.equals, source=f.source or recipe.source))

    def put(flag: str, value: str | None, source: Source, origin: Origin) -> None:
        for i, a in enumerate(args):
            if a.flag == flag:
                args[i] = Arg(flag=flag, value=value, equals=a.equals, source=source, origin=origin)
                return
        args.append(Arg(flag=flag, value=value, source=source, origin=origin))

    for flag, value in overrides.items():
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise InputError(f"override {flag!r} is not a long option", fix="write it as --flag-name")
        if flag == "--model":
            raise InputError("override --model: the model is vllm serve's positional argument",
                             fix="pick another recipe alias, or extend this one with another model.repo")
        if value is None or value is False:
            args = [a for a in args if a.flag != flag]
        else:
            put(flag, render_value(value), SRC_OVERRIDE, "override")
    current_tp = next((a.value for a in args if a.flag == "--tensor-parallel-size"), None)
    if tp != 1 or current_tp is not None:
        if current_tp != str(tp):
            put("--tensor-parallel-size", str(tp), SRC_TP, "tp")
    pp_arg = next((a.value for a in args if a.flag == "--pipeline-parallel-size"), None)
    if pp > 1 and pp_arg != str(pp):
        put("--pipeline-parallel-size", str(pp), SRC_PP, "tp")
    elif pp_arg is not None:
        pp = int(pp_arg) if pp_arg.isdigit() else 1
    if dp > 1:
        put("--data-parallel-size", str(dp), SRC_DP, "tp")
    if ep:
        put("--enable-expert-parallel", None, SRC_EP, "tp")
    engine_spans = tp * pp > 1 or (dp == 1 and (ctx.cluster_size or 1) > 1)  # one engine over several GPUs
    if engine_spans and not any(a.flag == "--distributed-executor-backend" for a in args):
        put("--distributed-executor-backend", "ray", SRC_RAY, "tp")
    put("--host", ctx.bind_host, SRC_BIND, "host")
    put("--port", str(ctx.port), SRC_BIND, "host")
    return args, pp


def _environment(recipe: ResolvedRecipe, ctx: HostServeContext, spans: bool) -> list[EnvVar]:
    """The container's environment: the store, offline, the recipe's variables, and for a launch
    that spans nodes the node's fabric bindings."""
    env: list[EnvVar] = [
        EnvVar(name="HF_HOME", value=ctx.model_store, source=SRC_STORE, origin="sparkprov"),
        EnvVar(name="HF_HUB_OFFLINE", value="1", source=SRC_OFFLINE, origin="sparkprov"),
    ]
    for name, ev in recipe.env.items():
        if name in ("HF_HOME", "HF_HUB_OFFLINE", "VLLM_API_KEY", "HF_TOKEN"):
            continue  # sparkprov owns these (the linter reports a recipe that sets them: G22/G24/G31)
        env.append(EnvVar(name=name, value=ev.value, source=ev.source or recipe.source))
    if spans:
        iface = ",".join(ctx.fabric_ifaces)
        fabric = {}
        if iface:
            fabric.update(NCCL_SOCKET_IFNAME=iface, GLOO_SOCKET_IFNAME=iface, UCX_NET_DEVICES=iface)
        if ctx.ib_hcas:
            fabric["NCCL_IB_HCA"] = ",".join(ctx.ib_hcas)
        if ctx.node_ip:
            fabric["VLLM_HOST_IP"] = ctx.node_ip
        env = [e for e in env if e.name not in fabric]
        env += [EnvVar(name=k, value=v, source=SRC_FABRIC, origin="host") for k, v in fabric.items()]
        topo = TOPOLOGY_ENV.get(ctx.fabric_topology or "", ())
        env = [e for e in env if e.name not in {k for k, _, _ in topo}]
        env += [EnvVar(name=k, value=v, source=src, origin="sparkprov") for k, v, src in topo]
    return env


def _mounts(recipe: ResolvedRecipe, ctx: HostServeContext) -> list[LaunchMount]:
    """The store, the compile cache, the API key (read-only) and the recipe's own mounts."""
    mounts = [
        LaunchMount(host=ctx.model_store, container=ctx.model_store, purpose="model store (HF_HOME)", source=SRC_STORE),
        LaunchMount(host=ctx.compile_cache, container=COMPILE_CACHE_IN_CONTAINER, purpose="torch.compile cache",
                    source=SRC_COMPILE),
    ]
    if ctx.api_key_file:
        mounts.append(LaunchMount(host=ctx.api_key_file, container=KEY_PATH, read_only=True, purpose="API key",
                                  source=SRC_KEY))
    for m in recipe.mounts:
        mounts.append(LaunchMount(host=_store_path(m.host, ctx, recipe), container=m.container,
                                  read_only=m.read_only, purpose=m.purpose, source=m.source or recipe.source))
    return mounts


def _docker_options(recipe: ResolvedRecipe) -> list[DockerOption]:
    """`docker run`'s options of the recipe (the name, detaching and the labels are the
    container's: serving/spec.py)."""
    d = recipe.docker
    docker_src = recipe.source_of("docker")
    options = [DockerOption(words=["--restart", d.restart], source=docker_src),
               DockerOption(words=["--gpus", "all"], source=SRC_GPUS, origin="sparkprov"),
               DockerOption(words=[f"--ipc={d.ipc}"], source=docker_src),
               DockerOption(words=["--network", "host"], source=SRC_NETWORK, origin="sparkprov")]
    if d.shm_size:
        options.append(DockerOption(words=["--shm-size", d.shm_size], source=docker_src))
    options += [DockerOption(words=["--ulimit", u], source=docker_src) for u in d.ulimits]
    return options
