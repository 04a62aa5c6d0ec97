"""Readers for recipe formats `invoke recipe import` takes besides eugr's and sparkrun's: each turns
a foreign document into the importer's typed model (`ForeignRecipe`, sparkprov/catalog/importer.py),
which the importer then converts and lints as it does the others.

* NVIDIA's recipe catalog (NVIDIA/local-ai-inference-recipes, `schema_version: 3` and `4`): one
  recipe per model x hardware x backend, with `checkpoint.target_label` (the repo), `runtime.image`,
  `topology` and `serve.command` (`export` lines, then `vllm serve ...`; the other ranks'
  commands in `serve.additional_commands`). Schema 4 adds `spec_dec` (the speculative decoding
  method), `min_vidmem_gb` (memory per node), `backend_min_version`, `prerequisites`,
  `topology.pipeline_parallel_size` and more hardware ids (DGX Station, RTX PRO, RTX Spark);
  sparkprov imports the DGX Spark ones: dgx-spark, dgx-spark-2gpu, dgx-spark-4gpu.
* spark-pulse's bundled recipes (`recipe_version: "2"` with `params:` and `engines:`): engine-neutral
  `params` (each becomes its vLLM option, as a sparkrun `defaults` does) and, per engine, `image`,
  `env`, `mods`, `build_args`, and `args` (the option tail, may use `{param}`) or a whole `command`.

Pure functions of the loaded document: nothing is read or written. Errors are positioned at the
foreign file's own keys; the importer's later errors (about `command`, `container`, `defaults`)
are pointed at the keys those came from (`aliased`). A foreign value is one value (the importer's
one_value): each reader checks the command as the file writes it, so an error names its line.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from pydantic import BaseModel, ConfigDict

from sparkprov.catalog.foreign import check_keys, command_text, one_value
from sparkprov.yamlpos import Positions, parse_model

NVIDIA = "nvidia"  # NVIDIA's recipe catalog, schema 3 or 4
SPARK_PULSE_V2 = "spark-pulse-v2"
NVIDIA_SCHEMAS = (3, 4)
# The top-level keys of NVIDIA's recipes (schema 3, and 4's additions), as the catalog's files write them
NVIDIA_KEYS = {"schema_version", "title", "model", "hardware", "platform", "backend", "backend_version", "status",
               "variant", "validation", "limitations", "precision", "checkpoint", "mtp", "concurrency", "topology",
               "sampling", "security", "runtime", "serve", "notes",
               "backend_min_version", "spec_dec", "min_vidmem_gb", "prerequisites"}
# hardware ids of DGX Spark configurations: one Spark, or N Sparks (dgx-spark-Ngpu)
_SPARK_HARDWARE = re.compile(r"dgx-spark(?:-([0-9]{1,2})gpu)?\Z")
SPARK_GIB = 128  # a DGX Spark's unified memory (GB10)
# spark-pulse's recipe_version 2 (spark_pulse/tools/recipe_schema.py RecipeV2), and what sparkprov reads besides
PULSE_KEYS = {"recipe_version", "name", "model", "description", "engine", "constraints", "params", "engines",
              "command", "model_revision", "env"}
_PARAM_KEY = re.compile(r"[a-z0-9][a-z0-9_-]*\Z")  # with -- and _ as -, a long option of vllm serve

# Options of vLLM's own multi-node launch that sparkprov sets per rank itself (cluster-up): an
# imported command keeps none of them (their values are per-node placeholders such as "$HEAD_IP").
RANK_OPTIONS = {"--nnodes": True, "--node-rank": True, "--master-addr": True, "--master-port": True,
                "--headless": False, "--data-parallel-address": True, "--data-parallel-rpc-port": True,
                "--data-parallel-start-rank": True, "--distributed-executor-backend": True}
_EXPORT = re.compile(r"export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)\Z")
# sparkrun's `defaults` keys that are no vLLM option (the importer maps tensor_parallel itself)
_PARAM_NOT_FLAG = {"port", "host", "name", "container", "model", "nodes"}


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NvidiaCheckpoint(_Loose):
    target_label: str | None = None
    draft_label: str | None = None


class NvidiaTopology(_Loose):
    node_count: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None  # schema 4


class NvidiaRuntime(_Loose):
    kind: str = "container"
    image: str | None = None
    setup_command: str | None = None


class NvidiaCommand(_Loose):
    id: str | None = None
    target: str | None = None
    command: str | None = None


class NvidiaServe(_Loose):
    target: str | None = None
    command: str | None = None
    api_model: str | None = None
    additional_commands: list[NvidiaCommand] | None = None


class NvidiaPlatform(_Loose):
    os: str | None = None
    execution: str | None = None


class NvidiaRecipe(_Loose):
    """The keys of an NVIDIA recipe (schema 3 or 4) sparkprov reads (the rest: pages and validation
    notes)."""

    schema_version: int
    title: str | None = None
    model: str | None = None
    hardware: str | None = None
    spec_dec: str | None = None           # schema 4: the speculative decoding method (mtp, eagle3, ...)
    min_vidmem_gb: float | None = None    # schema 4: memory each node needs
    backend: str | None = None
    backend_version: str | None = None
    status: str | None = None
    platform: NvidiaPlatform | None = None
    checkpoint: NvidiaCheckpoint | None = None
    topology: NvidiaTopology | None = None
    runtime: NvidiaRuntime | None = None
    serve: NvidiaServe | None = None
    notes: str | None = None


class PulseEngine(_Loose):
    image: str | None = None
    mods: list[Any] | None = None
    build_args: list[Any] | None = None
    env: dict[str, Any] | None = None
    args: str | list[str] | None = None
    command: str | None = None


class SparkPulseV2(_Loose):
    name: str | None = None
    model: str | None = None
    description: str | None = None
    model_revision: str | None = None
    engine: str | None = None
    params: dict[str, Any] | None = None
    engines: dict[str, PulseEngine] | None = None
    command: str | None = None
    env: dict[str, Any] | None = None


def format_of(data: Any) -> str | None:
    """NVIDIA, SPARK_PULSE_V2, or None for a document the importer's own formats cover."""
    if not isinstance(data, dict):
        return None
    if "schema_version" in data and "recipe_version" not in data:
        return NVIDIA
    if str(data.get("recipe_version", "")).strip() == "2" and ("engines" in data or "params" in data) \
            and "container" not in data and "defaults" not in data:
        return SPARK_PULSE_V2
    return None


def aliased(pos: Positions, where: dict[tuple, tuple]) -> Positions:
    """`pos` with each importer key (`("command",)`) also placed where its value came from."""
    out = Positions(pos.file, dict(pos.marks), dict(pos.key_marks))
    for mine, theirs in where.items():
        n = len(theirs)
        known = next((theirs[:k] for k in range(n, 0, -1) if theirs[:k] in pos.marks), None)
        if known is not None:  # a key the file lacks: point at where it would go
            out.marks[mine] = pos.marks[known]
        for table, src in ((out.marks, pos.marks), (out.key_marks, pos.key_marks)):
            for path, mark in src.items():
                if path[:n] == theirs:
                    table[mine + path[n:]] = mark
    return out


def _command_parts(text: str, where: tuple, pos: Positions) -> tuple[dict[str, str], list[str]]:
    """A serve command's `export NAME=VALUE` lines (as env) and the words of the rest (the vllm serve
    command), each value one value (at its line of `text`)."""
    command_text(text, where, pos)
    env: dict[str, str] = {}
    rest: list[str] = []
    for line in text.replace("\\\n", " ").split("\n"):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _EXPORT.match(stripped)
        if m:
            try:
                words = shlex.split(m[2], comments=True)  # `export X="0" # why` is X=0
            except ValueError as exc:
                raise pos.error(where, f"export {m[1]}: {exc}", fix="close the quote") from None
            env[m[1]] = " ".join(words)
            one_value(env[m[1]], where, pos, f"export {m[1]}", text=text)
            continue
        rest.append(stripped)
    try:
        return env, shlex.split(" ".join(rest))
    except ValueError as exc:
        raise pos.error(where, f"the command does not parse as shell words: {exc}", fix="close the quote") from None


def _without_rank_options(words: list[str], where: tuple, pos: Positions, text: str) -> tuple[str, list[str]]:
    """The command without the multi-node options sparkprov sets per rank (their values are the
    other tool's per-node placeholders, "$HEAD_IP"), and which were dropped; each word kept is one
    value."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(words):
        name = words[i].split("=", 1)[0]
        if name in RANK_OPTIONS:
            dropped.append(name)
            i += 1 if ("=" in words[i] or not RANK_OPTIONS[name]) else 2
            continue
        one_value(words[i], where, pos, "the command", text=text)
        kept.append(words[i])
        i += 1
    return shlex.join(kept), dropped


def _hardware_nodes(doc: NvidiaRecipe, pos: Positions) -> int | None:
    """How many Sparks the recipe's hardware is (dgx-spark: 1, dgx-spark-Ngpu: N); a hardware that is
    no DGX Spark is refused. None: the recipe names none."""
    if doc.hardware is None:
        return None
    m = _SPARK_HARDWARE.match(doc.hardware.strip())
    if not m:
        raise pos.error(("hardware",), f"hardware {doc.hardware[:40]!r}: sparkprov serves DGX Spark",
                        fix="import the recipe of dgx-spark, dgx-spark-2gpu or dgx-spark-4gpu")
    nodes = int(m[1] or 1)
    topo = doc.topology
    if topo and topo.node_count is not None and topo.node_count != nodes:
        raise pos.error(("topology", "node_count"), f"topology.node_count {topo.node_count} but hardware "
                        f"{doc.hardware} is {nodes} Spark(s)", fix="import a recipe whose topology matches its hardware")
    return nodes


def from_nvidia(data: dict[str, Any], pos: Positions) -> tuple[dict[str, Any], list[str], Positions]:
    """An NVIDIA recipe (schema 3 or 4) as the importer's foreign recipe fields, what did not carry
    over, and positions for the importer's keys."""
    check_keys(data, NVIDIA_KEYS, "an NVIDIA recipe (schema 3 or 4)", pos)
    doc = parse_model(NvidiaRecipe, data, pos)
    problems: list[str] = []
    if doc.schema_version not in NVIDIA_SCHEMAS:
        raise pos.error(("schema_version",), f"schema_version {doc.schema_version}: sparkprov reads NVIDIA's "
                        "recipe schemas 3 and 4", fix="import a recipe.yaml of NVIDIA/local-ai-inference-recipes")
    backend = (doc.backend or "").strip()
    if backend != "vllm":
        raise pos.error(("backend",), f"backend {backend[:40]!r}: sparkprov serves vLLM only",
                        fix="import the recipe of the vllm backend (…/linux/vllm/recipe.yaml)")
    execution = (doc.platform.execution if doc.platform else None) or (doc.runtime.kind if doc.runtime else None)
    if execution and execution != "container":
        raise pos.error(("platform", "execution"), f"execution {execution[:40]!r}: sparkprov runs vLLM in containers",
                        fix="import a recipe whose platform.execution is container")
    _hardware_nodes(doc, pos)
    if doc.min_vidmem_gb is not None and not 0 < doc.min_vidmem_gb <= SPARK_GIB:
        raise pos.error(("min_vidmem_gb",), f"min_vidmem_gb {doc.min_vidmem_gb:g}: a DGX Spark has {SPARK_GIB} GB "
                        "per node", fix="import a recipe for DGX Spark (min_vidmem_gb at most 128)")
    if not doc.serve or not (doc.serve.command or "").strip():
        raise pos.error(("serve",), "the recipe has no serve.command", fix="import a recipe with a `vllm serve` command")
    if not doc.runtime or not (doc.runtime.image or "").strip():
        raise pos.error(("runtime",), "the recipe names no container image", fix="add runtime.image: REPO:TAG")
    text = doc.serve.command or ""
    env, words = _command_parts(text, ("serve", "command"), pos)
    command, dropped = _without_rank_options(words, ("serve", "command"), pos, text)
    if dropped:
        problems.append(f"the multi-node options {', '.join(dict.fromkeys(dropped))} are sparkprov's to set per "
                        "node (cluster-up --executor native): not imported")
    topo = doc.topology or NvidiaTopology()
    for size, flag, short in ((topo.tensor_parallel_size, "--tensor-parallel-size", "-tp"),
                              (topo.pipeline_parallel_size, "--pipeline-parallel-size", "-pp")):
        if size and flag not in command and short not in command.split():
            command += f" {flag} {int(size)}"
    if doc.runtime and doc.runtime.setup_command:
        problems.append("runtime.setup_command (the docker run and its -e/-v options) is sparkprov's to build: "
                        "not imported (the fabric, store and key settings come from the inventory)")
    for extra in (doc.serve.additional_commands or []):
        problems.append(f"serve.additional_commands {extra.id or extra.target or '?'}: the other ranks' command is "
                        "derived from rank 0's by cluster-up: not imported")
    checkpoint = doc.checkpoint or NvidiaCheckpoint()
    if checkpoint.draft_label:
        problems.append(f"checkpoint.draft_label {checkpoint.draft_label[:80]}: the drafter's weights are not "
                        "staged by this recipe: add it under extra_repos (purpose: drafter)")
    rec: dict[str, Any] = {"recipe_version": "1", "name": doc.title or doc.model,
                           "description": doc.title, "model": checkpoint.target_label or doc.serve.api_model,
                           "container": doc.runtime.image, "command": command,
                           "env": env or None,
                           "metadata": {"nvidia_model": doc.model, "backend_version": doc.backend_version,
                                        "status": doc.status, "hardware": doc.hardware, "spec_dec": doc.spec_dec,
                                        "min_vidmem_gb": doc.min_vidmem_gb}}
    where = {("container",): ("runtime", "image"), ("command",): ("serve", "command"),
             ("model",): ("checkpoint", "target_label"), ("env",): ("serve", "command")}
    return rec, problems, aliased(pos, where)


def _param_flags(params: dict[str, Any], used: set[str]) -> list[str]:
    """spark-pulse params as vLLM options (as sparkrun's defaults are), but those `args` takes itself."""
    out: list[str] = []
    for key, value in params.items():
        if key in used or key in _PARAM_NOT_FLAG or value is None or value is False:
            continue
        name = {"tensor_parallel": "--tensor-parallel-size",
                "pipeline_parallel": "--pipeline-parallel-size",
                "data_parallel": "--data-parallel-size"}.get(key, "--" + str(key).replace("_", "-"))
        out.append(name)
        if value is not True:
            out.append(str(value))
    return out


def from_spark_pulse_v2(data: dict[str, Any], pos: Positions) -> tuple[dict[str, Any], list[str], Positions]:
    """A spark-pulse recipe (params + engines.vllm) as the importer's foreign recipe fields."""
    check_keys(data, PULSE_KEYS, "a spark-pulse recipe (recipe_version 2)", pos)
    doc = parse_model(SparkPulseV2, data, pos)
    problems: list[str] = []
    engines = doc.engines or {}
    if doc.engine and doc.engine != "vllm" and "vllm" not in engines:
        raise pos.error(("engine",), f"engine {doc.engine[:40]!r}: sparkprov serves vLLM only",
                        fix="import a recipe with an engines.vllm block")
    eng = engines.get("vllm") or PulseEngine()
    for other in engines:
        if other != "vllm":
            problems.append(f"engines.{other[:40]}: sparkprov serves vLLM only; that engine's block is not imported")
    if not (eng.image or "").strip():
        raise pos.error(("engines", "vllm") if "vllm" in engines else ("engines",),
                        "the recipe names no container image for vLLM", fix="add image: REPO:TAG under engines.vllm")
    params = dict(doc.params or {})
    for key in params:  # each becomes its option of vllm serve, as a sparkrun defaults key does
        if key not in _PARAM_NOT_FLAG and not _PARAM_KEY.match(str(key)):
            raise pos.error(("params", key), f"params key {str(key)[:40]!r} does not name an option of vllm serve",
                            fix="use the option's name with underscores, like max_model_len", key=True)
    at: tuple
    if eng.command or doc.command:
        command, at = (eng.command, ("engines", "vllm", "command")) if eng.command else (doc.command, ("command",))
        command_text(command, at, pos)
    else:
        at = ("engines", "vllm", "args")
        if isinstance(eng.args, str):
            command_text(eng.args, at, pos)
            try:
                words = shlex.split(eng.args.replace("\\\n", " "))
            except ValueError as exc:
                raise pos.error(at, f"the args do not parse as shell words: {exc}", fix="close the quote") from None
            for w in words:
                one_value(w, at, pos, "args", text=eng.args)
        for i, w in enumerate(eng.args if isinstance(eng.args, list) else []):
            one_value(w, at + (i,), pos, "args")
        tail = eng.args if isinstance(eng.args, str) else shlex.join(eng.args or [])
        used = set(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", tail))
        command = " ".join([shlex.join(["vllm", "serve", "{model}", *_param_flags(params, used)]), tail]).strip()
    rec: dict[str, Any] = {"recipe_version": "2", "name": doc.name, "description": doc.description,
                           "model": doc.model, "model_revision": doc.model_revision, "runtime": "vllm",
                           "container": eng.image, "command": command, "defaults": params or None,
                           "env": {**(doc.env or {}), **(eng.env or {})} or None,
                           "mods": eng.mods, "build_args": eng.build_args}
    where = {("container",): ("engines", "vllm", "image"), ("command",): at, ("defaults",): ("params",),
             ("env",): ("engines", "vllm", "env")}
    return rec, problems, aliased(pos, where)


READERS = {NVIDIA: from_nvidia, SPARK_PULSE_V2: from_spark_pulse_v2}


def read(data: Any, pos: Positions) -> tuple[str, dict[str, Any], list[str], Positions] | None:
    """(format, the importer's foreign recipe fields, problems, positions) for a document of one of
    these formats; None for one the importer reads itself."""
    fmt = format_of(data)
    if fmt is None:
        return None
    rec, problems, where = READERS[fmt](data, pos)
    return fmt, rec, problems, where
