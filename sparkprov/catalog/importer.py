"""Import recipes other Spark tools share into a sparkprov user recipe file.

Formats read:

* eugr/spark-vllm-docker recipes (`recipe_version: "1"` or none): `name`, `model`, `container`,
  `defaults` (port, host, tensor_parallel, gpu_memory_utilization, max_model_len, ...), `env`,
  `solo_only` / `cluster_only`, `mods`, `build_args`, and a `command` template (`vllm serve ...`
  with `{param}` filled from `defaults`).
* the `recipe_version: "2"` YAML of sparkrun / spark-pulse: the same keys plus `runtime`,
  `min_nodes` / `max_nodes`, `metadata`, `model_revision`, `pre_exec`, `variants`; `command` is
  optional (without it every `defaults` key that is not a launcher setting becomes `--key-name`).

The result is a user recipe (`recipes:` with one entry, `images:` where the file pins a digest),
every value sourced `user FILE: imported from FORMAT`. What sparkprov cannot take over (mods,
patches, pre_exec scripts, a non-vLLM runtime, an API key on the command line) is reported as a
problem, never silently dropped. `lint_imported` then runs every G-rule over the rendered launch.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sparkprov.catalog.knownflags import normalize
from sparkprov.catalog.models import ALIAS_RE

# Short options of `vllm serve` the recipes use, and their long names.
SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size",
         "-q": "--quantization", "-O": "--compilation-config", "-asc": "--api-server-count",
         "-n": "--nnodes", "-r": "--node-rank"}
# defaults keys that are launcher settings, not vLLM flags
LAUNCHER_KEYS = {"port", "host", "tensor_parallel", "pipeline_parallel", "data_parallel", "nodes", "name",
                 "container", "model"}
HOUSE_FLAGS = {"--host", "--port"}  # sparkprov sets them from the host (G31)
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass
class Imported:
    fmt: str  # "eugr" | "sparkrun-v2"
    alias: str
    recipe: dict[str, Any]
    images: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what did not carry over, each with the fix

    def yaml_text(self, origin: str) -> str:
        head = (f"# Imported by `invoke recipe import` from {origin} ({self.fmt} format).\n"
                + "".join(f"# NOT IMPORTED: {p}\n" for p in self.problems))
        doc: dict[str, Any] = {}
        if self.images:
            doc["images"] = self.images
        doc["recipes"] = [self.recipe]
        return head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=120)


def detect_format(data: Any) -> str:
    if not isinstance(data, dict):
        raise ValueError("a recipe file is a YAML mapping")
    version = str(data.get("recipe_version", "1")).strip()
    if version == "2":
        return "sparkrun-v2"
    if version == "1" and ("command" in data or "container" in data):
        return "eugr"
    raise ValueError(f"unknown recipe format (recipe_version {version!r}; expected eugr/spark-vllm-docker "
                     "or recipe_version \"2\")")


def _slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    return (s or "imported")[:64]


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _fill(template: str, params: dict[str, Any], problems: list[str]) -> str:
    def sub(m: re.Match) -> str:
        key = m[1]
        if key in params and params[key] is not None:
            return _scalar(params[key])
        problems.append(f"the command uses {{{key}}} and the recipe gives it no value (set it in defaults)")
        return m[0]
    return _PLACEHOLDER.sub(sub, template)


def _parse_serve(command: str, problems: list[str]) -> tuple[str | None, list[tuple[str, str | None]], str]:
    """(model, [(flag, value)], entry) from a `vllm serve ...` command line."""
    text = command.replace("\\\n", " ")
    try:
        words = shlex.split(text, comments=False)
    except ValueError as exc:
        raise ValueError(f"the command does not parse as shell words: {exc}") from None
    entry = "vllm serve"
    if words[:2] == ["vllm", "serve"]:
        rest = words[2:]
    elif len(words) >= 3 and words[0].startswith("python") and words[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
        rest, entry = words[3:], "python -m vllm.entrypoints.openai.api_server"
    elif "vllm" in words and "serve" in words:
        i = words.index("serve")
        problems.append(f"commands before `vllm serve` ({' '.join(words[:i - 1])}) are not imported: bake them "
                        "into an image (G24)")
        rest = words[i + 1:]
    else:
        raise ValueError("the command is not `vllm serve MODEL ...`: only vLLM recipes can be imported")
    model = None
    args: list[tuple[str, str | None]] = []
    i = 0
    if rest and not rest[0].startswith("-"):
        model, i = rest[0], 1
    while i < len(rest):
        w = rest[i]
        if not w.startswith("-"):
            problems.append(f"stray word {w!r} in the command (not a flag value)")
            i += 1
            continue
        name, eq, value = w.partition("=")
        if not name.startswith("--"):
            if name in SHORT:
                name = SHORT[name]
            elif re.fullmatch(r"-O\d", name):
                name, value, eq = "--compilation-config", name[2:], "="
            else:
                problems.append(f"short option {name} is not one sparkprov knows; write its long form")
                i += 1
                continue
        name = normalize(name)
        if eq:
            args.append((name, value))
            i += 1
        elif i + 1 < len(rest) and not (rest[i + 1].startswith("--") or rest[i + 1] in SHORT):
            args.append((name, rest[i + 1]))
            i += 2
        else:
            args.append((name, None))
            i += 1
    return model, args, entry


def _traits(model: str, args: dict[str, str | None]) -> dict[str, Any]:
    low = model.lower()
    family = next((f for f, pat in (("qwen3.6", "qwen3.6"), ("qwen3.5", "qwen3.5"), ("qwen3-next", "qwen3-next"),
                                    ("gemma4", "gemma-4"), ("nemotron3", "nemotron-3"), ("gpt-oss", "gpt-oss"),
                                    ("llama3", "llama-3")) if pat in low), _slug(low.rsplit("/", 1)[-1])[:24])
    q = (args.get("--quantization") or "").lower()
    if "nvfp4" in low or "fp4" in low:
        quant = "nvfp4-modelopt" if low.startswith("nvidia/") or q == "modelopt" else "nvfp4-ct"
    elif "mxfp4" in low or family == "gpt-oss":
        quant = "mxfp4"
    elif "fp8" in low:
        quant = "fp8"
    elif "gptq" in low or "int4" in low:
        quant = "gptq-int4"
    elif "awq" in low:
        quant = "awq"
    elif q == "fp8":
        quant = "fp8-runtime"
    else:
        quant = "unknown"
    ssm = {"qwen3.6": ["gated_deltanet"], "qwen3.5": ["gated_deltanet"], "qwen3-next": ["gated_deltanet"],
           "nemotron3": ["mamba2"]}.get(family, [])
    out: dict[str, Any] = {"family": family, "quant": quant, "moe": bool(re.search(r"-a\d+(\.\d+)?b", low))}
    if ssm:
        out["ssm_layers"] = ssm
    if family.startswith("qwen3"):
        out["thinking"] = "on" if args.get("--reasoning-parser") else "none"
    return out


def convert(data: dict[str, Any], *, origin: str, alias: str | None = None, variant: str | None = None) -> Imported:
    """One foreign recipe as a sparkprov user recipe (a dict ready for YAML) and its problems."""
    fmt = detect_format(data)
    problems: list[str] = []
    src = f"user {Path(origin).name}: imported from a {fmt} recipe"
    if variant:
        variants = data.get("variants") or {}
        if variant not in variants:
            raise ValueError(f"no variant {variant!r} (variants: {', '.join(variants) or 'none'})")
        over = dict(variants[variant])
        data = {**data, "defaults": {**(data.get("defaults") or {}),
                                     **{k: v for k, v in over.items() if k not in ("description", "container",
                                                                                    "env", "patches")}},
                "env": {**(data.get("env") or {}), **(over.get("env") or {})}}
        if "container" in over:
            data["container"] = over["container"]
    if fmt == "sparkrun-v2":
        runtime = str(data.get("runtime", "vllm"))
        if not runtime.startswith("vllm"):
            raise ValueError(f"runtime {runtime!r}: sparkprov serves vLLM only")
    defaults = dict(data.get("defaults") or {})
    model_repo = data.get("model")
    params = {**defaults, "model": model_repo}
    if "command" in data and data["command"]:
        command = _fill(str(data["command"]), params, problems)
        model, args, entry = _parse_serve(command, problems)
    else:
        model, args, entry = model_repo, [], "vllm serve"
        for k, v in defaults.items():
            if k in LAUNCHER_KEYS or v is None or v is False:
                continue
            args.append(("--" + k.replace("_", "-"), None if v is True else _scalar(v)))
        if defaults.get("tensor_parallel"):
            args.append(("--tensor-parallel-size", _scalar(defaults["tensor_parallel"])))
    flags = dict(args)
    if "--model" in flags:
        model = model or flags["--model"]
        problems.append("the command passes --model (deprecated in vllm serve): converted to the positional model")
    model = model or model_repo
    if not model:
        raise ValueError("the recipe names no model (model: or vllm serve MODEL)")
    if model_repo and model != model_repo and not str(model).startswith("/"):
        problems.append(f"the command serves {model} while model: says {model_repo}; the command wins")
    tp = int(float(flags.get("--tensor-parallel-size") or defaults.get("tensor_parallel") or 1))
    pp = int(float(flags.get("--pipeline-parallel-size") or 1))
    out_args: list[Any] = []
    for name, value in args:
        if name in ("--model", "--tensor-parallel-size"):
            continue
        if name in HOUSE_FLAGS:
            continue  # sparkprov binds from the host's vars (G31)
        if name == "--api-key":
            problems.append("--api-key on the command line shows in `ps` and `docker inspect`: removed; sparkprov "
                            "passes the host's 0600 key file (G31)")
            continue
        out_args.append(name if value is None else {name: value})
    container = str(data.get("container") or "")
    if not container:
        raise ValueError("the recipe names no container image")
    image = container if ":" in container.rsplit("/", 1)[-1] or "@" in container else container + ":latest"
    for key in ("mods", "patches", "pre_exec", "build_args"):
        if data.get(key):
            problems.append(f"{key} ({', '.join(map(str, data[key]))}) change the image or run scripts at start: "
                            "not imported; bake them into a derived image and name it in image:")
    if entry != "vllm serve":
        problems.append(f"the command starts vLLM with `{entry}`; sparkprov runs `vllm serve` (same options)")
    env = {str(k): _scalar(v) for k, v in (data.get("env") or {}).items()}
    for k in ("HF_TOKEN", "VLLM_API_KEY", "HF_HOME"):
        if k in env:
            env.pop(k)
            problems.append(f"env {k} is sparkprov's to set (G22/G26/G31): removed")
    nodes = tp * pp
    name = str(data.get("name") or Path(origin).stem)
    alias = alias or _slug(name + (f"-{variant}" if variant else ""))
    if not ALIAS_RE.match(alias):
        raise ValueError(f"{alias!r} is not a valid alias")
    description = data.get("description") or (data.get("metadata") or {}).get("description") or name
    recipe: dict[str, Any] = {
        "alias": alias,
        "title": " ".join(str(description).split())[:160],
        "source": src,
        "model": {"repo": str(model)} if not str(model).startswith("/") else {"repo": str(model_repo or model)},
        "gated": False,
        "traits": _traits(str(model_repo or model), flags),
        "image": image,
        "args": out_args,
        "tp_sizes": [tp],
    }
    if recipe["traits"].get("thinking") == "on":  # sparkprov's smoke test, not the foreign recipe's (G28)
        recipe["smoke"] = {"chat_template_kwargs": {"enable_thinking": False}}
    if data.get("model_revision"):
        recipe["model"]["revision"] = str(data["model_revision"])
    if env:
        recipe["env"] = env
    if str(model).startswith("/"):
        problems.append(f"the command serves a container path {model}: mount it with mounts: (not imported)")
    recipe["notes"] = [f"imported from {origin} ({fmt}); gated unknown: set gated: true for a gated repo"]
    if nodes > 1:
        recipe["notes"].append(f"spans {nodes} Sparks (tp {tp} x pp {pp})")
    images = []
    if "@sha256:" in image:
        ref, digest = image.split("@", 1)
        recipe["image"] = ref if ":" in ref.rsplit("/", 1)[-1] else ref + ":latest"
        images.append({"ref": recipe["image"], "digest": digest, "entrypoint": "custom", "source": src})
    return Imported(fmt=fmt, alias=alias, recipe=recipe, images=images, problems=problems)


def import_file(path: str | Path, *, alias: str | None = None, variant: str | None = None) -> Imported:
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {exc}") from None
    return convert(data, origin=str(path), alias=alias, variant=variant)


def lint_imported(out_file: str | Path, alias: str, *, flags_cache: str | None = None):
    """Load the written user file over the catalog, render the launch and run every G-rule."""
    from sparkprov.catalog.lint import lint_launch
    from sparkprov.catalog.load import load_catalog
    from sparkprov.catalog.render import HostServeContext, render_launch

    cat = load_catalog([out_file])
    r = cat.get(alias)
    launch = render_launch(r, HostServeContext(), min(r.tp_sizes), catalog=cat)
    return launch, lint_launch(launch, catalog=cat, flags_cache=flags_cache)
