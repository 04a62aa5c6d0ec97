"""Import recipes other Spark tools share into a sparkprov user recipe file.

Formats read:

* eugr/spark-vllm-docker recipes (`recipe_version: "1"` or none): `name`, `model`, `container`,
  `defaults` (port, host, tensor_parallel, gpu_memory_utilization, max_model_len, ...), `env`,
  `solo_only` / `cluster_only`, `mods`, `build_args`, and a `command` template (`vllm serve ...`
  with `{param}` filled from `defaults`).
* the `recipe_version: "2"` YAML of sparkrun / spark-pulse: the same keys plus `runtime`,
  `min_nodes` / `max_nodes`, `metadata`, `model_revision`, `pre_exec`, `variants`; `command` is
  optional (without it every `defaults` key that is not a launcher setting becomes `--key-name`).

The file is read through the bounded reader and the positioned YAML loader (a FIFO, a device, an
alias bomb or a value of the wrong shape is one line FILE:LINE:COL), and typed (`ForeignRecipe`)
before anything is converted. A foreign value is one value (catalog/foreign.py): a line break or a
shell expansion in a value that reaches the launch, a line break other than \\n in a command, or a
top-level key the format lacks is an error at its line; a command is split into words before its
`{placeholders}` are filled, so a filled value stays one word. The result is a user recipe (`recipes:` with one entry), every value
sourced `user FILE: imported from FORMAT`, emitted with yaml.safe_dump from data: a foreign value
never becomes YAML syntax. What sparkprov cannot take over (mods, patches, pre_exec scripts, a
non-vLLM runtime, an API key on the command line) is reported as a problem, never silently
dropped; a command that is no `vllm serve` command line (a stray word, an option vLLM has no
such name for) is an error, and an import with an error writes nothing. `lint_imported` loads the
text over the catalog and runs every G-rule over the rendered launch, before the CLI writes anything.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError

from sparkprov.catalog.knownflags import normalize
from sparkprov.imageref import IMAGE_RE, ImageRef
from sparkprov.catalog.models import ALIAS_RE, REPO_ID_RE, REVISION_RE
from sparkprov.catalog.foreign import check_keys, command_text, one_value
from sparkprov.errors import InputError, one_line
from sparkprov.yamlpos import Positions, load_yaml, parse_model, validation_error

# Short options of `vllm serve` the recipes use, and their long names.
SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size",
         "-q": "--quantization", "-O": "--compilation-config", "-asc": "--api-server-count",
         "-n": "--nnodes", "-r": "--node-rank"}
# defaults keys that are launcher settings, not vLLM flags
LAUNCHER_KEYS = {"port", "host", "tensor_parallel", "pipeline_parallel", "data_parallel", "nodes", "name",
                 "container", "model"}
HOUSE_FLAGS = {"--host", "--port"}  # sparkprov sets them from the host (G31)
# `{{`, `}}` and `{name}`: the pieces of a command template (see _fill)
_TEMPLATE_PART = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
# A filled command is a few KB; a placeholder repeated over a large value could make it gigabytes.
MAX_COMMAND = 256 * 2**10
_FLAG_NAME = re.compile(r"--[a-z0-9][a-z0-9-]*\Z")
_DOTTED = re.compile(r"--[a-z0-9][a-z0-9-]*(\.[A-Za-z0-9_-]+)+\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The top-level keys of each format (the keys the other tool defines, read or not by sparkprov):
# a key outside them is a misspelling, named with the keys there are.
EUGR_KEYS = {"recipe_version", "name", "description", "model", "container", "command", "defaults", "env", "mods",
             "build_args", "cluster_only", "solo_only"}  # eugr/spark-vllm-docker run-recipe.py load_recipe
# sparkrun (spark-arena/sparkrun src/sparkrun/core/recipe.py _KNOWN_KEYS), and the variants and
# patches sparkprov reads besides
SPARKRUN_KEYS = {"sparkrun_version", "recipe_version", "name", "description", "model", "model_revision", "runtime",
                 "runtime_version", "mode", "min_nodes", "max_nodes", "container", "containers", "defaults", "env",
                 "command", "runtime_config", "cluster_only", "solo_only", "benchmark", "metadata", "pre_exec",
                 "post_exec", "post_commands", "mods", "stop_after_post", "builder", "builder_config", "executor",
                 "executor_config", "scheduler", "distribution_config", "layout", "cluster_config", "runtime_cache",
                 "readiness", "capabilities", "unsupported_capabilities", "include", "overrides", "variants",
                 "patches", "build_args"}


def _single_value(v: Any) -> Any:
    """A value a command template can take: text, a number, true/false or nothing."""
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    raise ValueError(f"expected a single value (text, a number, true/false), not a {_shape(v)}")


def _text(v: Any) -> Any:
    """Text; a bare number (`name: 123`, `recipe_version: 1`) reads as the text it was written as."""
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ValueError(f"expected text, not {_shape(v)}")
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _shape(v: Any) -> str:
    return {dict: "mapping", list: "list", bool: "true/false"}.get(type(v), type(v).__name__)


Value = Annotated[Any, PlainValidator(_single_value)]
Text = Annotated[str, PlainValidator(_text)]


class ForeignRecipe(BaseModel):
    """The keys of a foreign recipe sparkprov reads, each of the shape its tool gives it. Other
    keys (executor_config, distribution_config, builder, ...) belong to the other tool: ignored."""

    model_config = ConfigDict(extra="ignore")

    recipe_version: Text = "1"
    name: Text | None = None
    description: Text | None = None
    model: Text | None = None
    model_revision: Text | None = None
    runtime: Text | None = None
    container: Text | None = None
    command: Text | None = None
    defaults: dict[str, Value] | None = None
    env: dict[str, Value] | None = None
    mods: list[Any] | None = None
    patches: list[Any] | None = None
    pre_exec: list[Any] | None = None
    build_args: list[Any] | None = None
    metadata: dict[str, Any] | None = None
    variants: dict[str, dict[str, Any]] | None = None


# What each key of a foreign recipe holds, said as the fix when it holds something else.
SHAPES = {"defaults": "a mapping of names to single values (max_model_len: 65536)",
          "env": "a mapping of variable names to values (VLLM_X: \"1\")",
          "variants": "a mapping of variant names to mappings of values",
          "metadata": "a mapping (description: ...)",
          "command": "the `vllm serve ...` command as text (a `|` block)"}
for _key in ("mods", "patches", "pre_exec", "build_args"):
    SHAPES[_key] = "a list (- one entry per line)"


def _typed(data: dict[str, Any], pos: Positions) -> "ForeignRecipe":
    try:
        return ForeignRecipe.model_validate(data)
    except ValidationError as exc:
        err = validation_error(exc, pos, model=ForeignRecipe)
        key = str((exc.errors()[0].get("loc") or ("",))[0])
        err.fix = err.fix or f"write {key} as {SHAPES.get(key, 'text')}"
        raise err from None


def one_values(rec: "ForeignRecipe", pos: Positions) -> None:
    """Every value of the recipe that reaches the launch is one value (not_one_value), at its line."""
    for key in ("model", "model_revision", "container"):
        one_value(getattr(rec, key), (key,), pos, key)
    for section in ("defaults", "env"):
        for k, v in (getattr(rec, section) or {}).items():
            one_value(_scalar(v) if v is not None else None, (section, k), pos, f"{section} {k}")


class VariantOverride(BaseModel):
    """A sparkrun variant's own keys; every other key of it is a `defaults` value."""

    model_config = ConfigDict(extra="ignore")

    description: Text | None = None
    container: Text | None = None
    env: dict[str, Value] | None = None
    patches: list[Any] | None = None


@dataclass
class Imported:
    fmt: str  # "eugr" | "sparkrun-v2"
    alias: str
    recipe: dict[str, Any]
    problems: list[str] = field(default_factory=list)  # what did not carry over, each with the fix

    def document(self) -> dict[str, Any]:
        return {"recipes": [self.recipe]}

    def yaml_text(self, origin: str) -> str:
        # Comments are the one place text is written by hand: each is one line (every line break
        # and control character escaped), so no foreign value can end a comment and start YAML.
        head = (one_line(f"# Imported by `invoke recipe import` from {origin} ({self.fmt} format).") + "\n"
                + "".join(one_line(f"# NOT IMPORTED: {p}") + "\n" for p in self.problems))
        return head + yaml.dump(self.document(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)


class _Dumper(yaml.SafeDumper):
    r"""safe_dump, with every string holding a line break other than \n, or a control character,
    written double-quoted (escaped). PyYAML writes such a string single-quoted and reads it back
    changed: a lone NEL (\x85) comes back as a space."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    plain_breaks_only = all(c.isprintable() or c == "\n" for c in value)
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=None if plain_breaks_only else '"')


_Dumper.add_representer(str, _represent_str)


def detect_format(data: Any, pos: Positions | None = None) -> str:
    pos = pos or Positions("")
    if not isinstance(data, dict):
        raise pos.error((), "a recipe file is a YAML mapping (recipe_version, model, container, command, ...)",
                        fix="name an eugr/spark-vllm-docker or sparkrun recipe file")
    raw = data.get("recipe_version", "1")
    try:
        version = _text(raw).strip()
    except ValueError as exc:
        raise pos.error(("recipe_version",), f"recipe_version: {exc}", fix='write recipe_version: "1" or "2"') from None
    if version == "2":
        return "sparkrun-v2"
    if version == "1" and ("command" in data or "container" in data):
        return "eugr"
    where = ("recipe_version",) if "recipe_version" in data else ()
    raise pos.error(where, f"unknown recipe format (recipe_version {version[:40]!r})",
                    fix='import an eugr/spark-vllm-docker recipe (recipe_version "1") or a sparkrun one ("2")')


def _slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    return (s or "imported")[:64].rstrip("-._") or "imported"


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _brief(items: list[Any]) -> str:
    """The first few entries of a list, each cut short: a problem line stays a line."""
    shown = [(_scalar(i) if isinstance(i, (str, int, float, bool)) else _shape(i))[:80] for i in items[:3]]
    return ", ".join(shown) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def _fill(template: str, params: dict[str, Any], problems: list[str], pos: Positions) -> tuple[list[str], set[str]]:
    """The command's words, each `{name}` in a word replaced by params[name]: the command is split
    into words first, so a value stays inside the word that names it, whatever it holds (a space,
    quotes) and a value is one value. Braces follow the tools' convention (sparkrun's
    text.uses_brace_escapes; eugr's run-recipe.py runs str.format): a template that holds `{{`
    escapes every literal brace by doubling it, so `{{` and `}}` become `{` and `}`; in one without
    `{{`, a brace that is not a placeholder is literal (a JSON value such as '{"method":"mtp"}' in
    a sparkrun command)."""
    escapes = "{{" in template
    size = len(template)
    unfilled: set[str] = set()  # the `{name}`s left in the text: no value for them

    def sub(m: re.Match) -> str:
        nonlocal size
        if m[1] is None:  # `{{` or `}}`
            return m[0][0] if escapes else m[0]
        key = m[1]
        if key in params and params[key] is not None:
            value = _scalar(params[key])
            size += len(value)
            if size > MAX_COMMAND:
                raise pos.error(("command",), f"the command grows past {MAX_COMMAND // 1024} KiB once its "
                                "placeholders are filled", fix="check the values in defaults")
            return value
        problems.append(f"the command uses {{{key}}} and the recipe gives it no value: the option that takes it is "
                        "left out (set it in defaults)")
        unfilled.add(m[0])
        return m[0]

    return [_TEMPLATE_PART.sub(sub, w) for w in _shell_words(template, ("command",), pos)], unfilled


def _shell_words(command: str, where: tuple, pos: Positions) -> list[str]:
    try:
        return shlex.split(command.replace("\\\n", " "), comments=False)
    except ValueError as exc:
        raise pos.error(where, f"the command does not parse as shell words: {exc}", fix="close the quote") from None


def _parse_serve(words: list[str], problems: list[str], pos: Positions
                 ) -> tuple[str | None, list[tuple[str, str | None]], str]:
    """(model, [(flag, value)], entry) from a `vllm serve ...` command's words. A word that is no
    option of vllm serve is an error: the options after it would not be what the recipe meant."""
    entry = "vllm serve"
    if words[:2] == ["vllm", "serve"]:
        rest = words[2:]
    elif len(words) >= 3 and words[0].startswith("python") and words[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
        rest, entry = words[3:], "python -m vllm.entrypoints.openai.api_server"
    elif (at := next((j for j in range(len(words) - 1) if words[j:j + 2] == ["vllm", "serve"]), None)) is not None:
        problems.append(f"commands before `vllm serve` ({_brief(words[:at])}) are not imported: bake them "
                        "into an image (G24)")
        rest = words[at + 2:]
    else:
        raise pos.error(("command",), "the command is not `vllm serve MODEL ...`",
                        fix="only vLLM recipes can be imported")
    model = None
    args: list[tuple[str, str | None]] = []
    i = 0
    if rest and not rest[0].startswith("-"):
        model, i = rest[0], 1
    while i < len(rest):
        w = rest[i]
        if not w.startswith("-"):
            raise pos.error(("command",), f"the word {w[:80]!r} after {rest[i - 1][:40] if i else 'the model'} is "
                            "neither an option nor its value", fix="quote a value that holds spaces")
        name, eq, value = w.partition("=")
        if not name.startswith("--"):
            if name in SHORT:
                name = SHORT[name]
            elif re.fullmatch(r"-O\d", name):
                name, value, eq = "--compilation-config", name[2:], "="
            else:
                raise pos.error(("command",), f"short option {name[:40]!r} is not one sparkprov knows",
                                fix="write its long form (like --tensor-parallel-size)")
        name = normalize(name)
        taken = 1
        if not eq and i + 1 < len(rest) and not (rest[i + 1].startswith("--") or rest[i + 1] in SHORT):
            value, taken = rest[i + 1], 2
        elif not eq:
            value = None
        i += taken
        if _DOTTED.match(name):  # vLLM's --json-option.key=value: one key of a JSON option
            problems.append(f"{name[:60]} (vLLM's dotted form of a JSON option) is not imported: write the option "
                            "whole, as JSON")
            continue
        if not _FLAG_NAME.match(name):
            raise pos.error(("command",), f"{name[:40]!r} is not a long option of vllm serve",
                            fix="write the option as vllm serve names it (like --max-model-len)")
        if value is not None and "\0" in value:
            raise pos.error(("command",), f"the value of {name} holds a NUL character, which no argv can carry",
                            fix="remove it")
        args.append((name, value))
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


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _count(value: Any, what: str, where: tuple, pos: Positions, hi: int = 64) -> int:
    """A tensor/pipeline-parallel size as the recipe writes it (4, "4", 4.0), 1..hi."""
    text = _scalar(value).strip()
    m = re.fullmatch(r"([0-9]{1,4})(\.0*)?", text)
    if not m or not 1 <= int(m[1]) <= hi:
        raise pos.error(where, f"{what} {text[:40]!r} is not a whole number from 1 to {hi}",
                        fix=f"give the {what} as a number of Sparks")
    return int(m[1])


def _variant(rec: ForeignRecipe, name: str, pos: Positions) -> ForeignRecipe:
    """The recipe with a sparkrun variant applied: its values over `defaults`, its env over `env`."""
    variants = rec.variants or {}
    if name not in variants:
        raise InputError(f"--variant {name[:80]!r}: the recipe has no such variant",
                         fix=f"variants in {pos.file}: {', '.join(list(variants)[:10]) or 'none'}")
    raw = variants[name]
    base = ("variants", name)
    try:
        over = parse_model(VariantOverride, raw, pos, prefix=base)
    except InputError as exc:
        exc.fix = exc.fix or "a variant holds description and container (text), env (a mapping), defaults values"
        raise
    values = {}
    for key, value in raw.items():
        if key in VariantOverride.model_fields:
            continue
        try:
            values[key] = _single_value(value)
        except ValueError as exc:
            raise pos.error(base + (key,), f"{key}: {exc}", fix="a variant sets defaults values: one value each") from None
        one_value(value, base + (key,), pos, f"variant {name}: {key}")
    for k, v in (over.env or {}).items():
        one_value(_scalar(v) if v is not None else None, base + ("env", k), pos, f"variant {name}: env {k}")
    one_value(over.container, base + ("container",), pos, f"variant {name}: container")
    update: dict[str, Any] = {"defaults": {**(rec.defaults or {}), **values},
                              "env": {**(rec.env or {}), **(over.env or {})}}
    if over.container:
        update["container"] = over.container
    if over.patches:
        update["patches"] = [*(rec.patches or []), *over.patches]
    return rec.model_copy(update=update)


# Long on purpose: a foreign recipe's fields converted one after the other, each at its own key.
def convert(data: Any, *, origin: str, alias: str | None = None, variant: str | None = None,
            pos: Positions | None = None) -> Imported:
    """One foreign recipe as a sparkprov user recipe (a dict ready for YAML) and its problems.
    Every error is an InputError at the key it comes from (FILE:LINE:COL where `pos` knows it)."""
    pos = pos or Positions(str(origin))
    from sparkprov.catalog import import_formats  # NVIDIA schema 3, spark-pulse params/engines

    problems: list[str] = []
    other = import_formats.read(data, pos)  # each reader checks its own keys and its command as written
    if other:
        fmt, data, problems, pos = other
    else:
        fmt = detect_format(data, pos)
        check_keys(data, SPARKRUN_KEYS if fmt == "sparkrun-v2" else EUGR_KEYS | SPARKRUN_KEYS,
                   "a sparkrun recipe" if fmt == "sparkrun-v2" else "an eugr/spark-vllm-docker or sparkrun recipe",
                   pos)
    rec = _typed(data, pos)
    one_values(rec, pos)
    if rec.command and not other:
        command_text(rec.command, ("command",), pos)
    if variant:
        rec = _variant(rec, variant, pos)
    src = f"user {one_line(Path(origin).name)}: imported from a {fmt} recipe"
    if fmt == "sparkrun-v2":
        runtime = rec.runtime or "vllm"
        if not runtime.startswith("vllm"):
            raise pos.error(("runtime",), f"runtime {runtime[:40]!r}: sparkprov serves vLLM only",
                            fix="import a recipe whose runtime is vllm")
    defaults = dict(rec.defaults or {})
    model_repo = rec.model
    params = {**defaults, "model": model_repo}
    unfilled: set[str] = set()
    if rec.command:
        words, unfilled = _fill(rec.command, params, problems, pos)
        model, args, entry = _parse_serve(words, problems, pos)
        model_at: tuple = ("command",)
    else:
        model, args, entry, model_at = model_repo, _launcher_args(defaults, pos), "vllm serve", ("model",)
    flags = dict(args)
    model, repo = _served(model, model_repo, flags, model_at, problems, pos)
    container_path = model.startswith("/")
    tp, pp = _sizes(flags, defaults, pos)
    out_args = _kept_args(args, unfilled, problems, pos, ("command",) if rec.command else ("defaults",),
                          rec.command)
    image = _image(rec, data, pos)
    problems += _not_imported(rec, entry)
    env = _environment(rec, problems, pos)
    nodes = tp * pp
    name = rec.name or Path(origin).stem
    alias = alias or _slug(name + (f"-{variant}" if variant else ""))
    if not ALIAS_RE.match(alias) or alias == "all":
        raise InputError(f"--name {alias[:80]!r} is not a valid alias",
                         fix="use lowercase letters, digits, '.', '_' and '-' (at most 64), not 'all'")
    meta = rec.metadata or {}
    description = rec.description or (meta.get("description") if isinstance(meta.get("description"), str) else None)
    recipe: dict[str, Any] = {
        "alias": alias,
        # one line: the title stands in tables and `invoke models --plain` rows
        "title": " ".join((description or name).split())[:160] or alias,
        "source": src,
        "model": {"repo": repo},
        "gated": False,
        "traits": _traits(repo, flags),
        "image": image,
        "args": out_args,
        "tp_sizes": [tp],
    }
    if recipe["traits"].get("thinking") == "on":  # sparkprov's smoke test, not the foreign recipe's (G28)
        recipe["smoke"] = {"chat_template_kwargs": {"enable_thinking": False}}
    if rec.model_revision:
        if not REVISION_RE.match(rec.model_revision):
            raise pos.error(("model_revision",), f"model_revision {rec.model_revision[:80]!r} is not a branch, tag "
                            "or commit", fix="write a commit id, a branch or a tag")
        recipe["model"]["revision"] = rec.model_revision
    if env:
        recipe["env"] = env
    if container_path:
        problems.append(f"the command serves a container path {model[:80]}: sparkprov serves {repo} from the "
                        "store instead")
    recipe["notes"] = [f"imported from {origin} ({fmt}); gated unknown: set gated: true for a gated repo"]
    if nodes > 1:
        recipe["notes"].append(f"spans {nodes} Sparks (tp {tp} x pp {pp})")
    return Imported(fmt=fmt, alias=alias, recipe=recipe, problems=problems)


def _sizes(flags: dict[str, str | None], defaults: dict[str, Any], pos: Positions) -> tuple[int, int]:
    """(tp, pp): the command's sizes, else the defaults' tensor_parallel."""
    tp_value = flags.get("--tensor-parallel-size") or defaults.get("tensor_parallel") or 1
    from_defaults = "tensor_parallel" in defaults and _scalar(tp_value) == _scalar(defaults["tensor_parallel"])
    tp = _count(tp_value, "tensor-parallel size", ("defaults", "tensor_parallel") if from_defaults else ("command",),
                pos)
    return tp, _count(flags.get("--pipeline-parallel-size") or 1, "pipeline-parallel size", ("command",), pos)


def _not_imported(rec: Any, entry: str) -> list[str]:
    """What the foreign recipe does that an import leaves out: image changes and start scripts,
    another way of starting vLLM."""
    out = [f"{key} ({_brief(items)}) change the image or run scripts at start: not imported; bake them into "
           "a derived image and name it in image:" for key in ("mods", "patches", "pre_exec", "build_args")
           if (items := getattr(rec, key))]
    if entry != "vllm serve":
        out.append(f"the command starts vLLM with `{entry}`; sparkprov runs `vllm serve` (same options)")
    return out


def _launcher_args(defaults: dict[str, Any], pos: Positions) -> list[tuple[str, str | None]]:
    """vllm serve's options from a recipe's `defaults` where it has no command (launcher keys aside)."""
    args: list[tuple[str, str | None]] = []
    for k, v in defaults.items():
        if k in LAUNCHER_KEYS or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if not _FLAG_NAME.match(flag):
            raise pos.error(("defaults", k), f"defaults key {k[:40]!r} does not name an option of vllm serve",
                            fix="use the option's name with underscores, like max_model_len", key=True)
        args.append((flag, None if v is True else _scalar(v)))
    if defaults.get("tensor_parallel"):
        args.append(("--tensor-parallel-size", _scalar(defaults["tensor_parallel"])))
    return args


def _served(model: str | None, model_repo: str | None, flags: dict[str, str | None], model_at: tuple,
            problems: list[str], pos: Positions) -> tuple[str, str]:
    """(what the command serves, the Hugging Face repo whose weights those are): the command's
    model wins over model:, which names the repo of a container path."""
    if "--model" in flags:
        model = model or flags["--model"]
        problems.append("the command passes --model (deprecated in vllm serve): converted to the positional model")
    model = model or model_repo
    if not model:
        raise pos.error((), "the recipe names no model", fix="add model: ORG/NAME (or vllm serve ORG/NAME)")
    container_path = model.startswith("/")
    repo = model_repo if container_path or not model_repo else model
    if model_repo and model != model_repo and not container_path:
        problems.append(f"the command serves {model[:80]} while model: says {model_repo[:80]}; the command wins")
    if not repo:
        raise pos.error(model_at, f"the command serves the container path {model[:80]!r} and model: names no repo",
                        fix="add model: ORG/NAME, the repo whose weights are there")
    if not REPO_ID_RE.match(repo):
        at = ("model",) if repo == model_repo else model_at
        raise pos.error(at, f"{repo[:80]!r} is not a Hugging Face repo id", fix="write it as ORG/NAME")
    return model, repo


def _kept_args(args: list[tuple[str, str | None]], unfilled: set[str], problems: list[str], pos: Positions,
               at: tuple, command: str | None) -> list[Any]:
    """The recipe's args: the model, the layout's sizes and the host's binding left out (sparkprov's),
    --api-key removed (G31); a value that is not one value (foreign.one_value: a line break, a shell
    expansion), or a JSON value that is not JSON, refused at `at`."""
    out: list[Any] = []
    for name, value in args:
        if name in ("--model", "--tensor-parallel-size"):
            continue
        if name in HOUSE_FLAGS:
            continue  # sparkprov binds from the host's vars (G31)
        if value is not None and any(u in value for u in unfilled):
            continue  # reported by _fill
        if name == "--api-key":
            problems.append("--api-key on the command line shows in `ps` and `docker inspect`: removed; sparkprov "
                            "passes the host's 0600 key file (G31)")
            continue
        if value is not None:  # a word of the command, or a defaults value (checked where it is written)
            one_value(value, ("command",), pos, f"the value of {name}", text=command)
        if value is not None and value.lstrip()[:1] in ("{", "[") and not _is_json(value):
            # vLLM reads such a value with json.loads: the container would exit at start
            raise pos.error(at, f"the value of {name} ({value[:60]!r}) is not JSON, and vLLM reads it as JSON",
                            fix="write it as JSON (in an eugr command, a literal brace is doubled: {{ }})")
        out.append(name if value is None else {name: value})
    return out


def _image(rec: Any, data: Any, pos: Positions) -> str:
    """The recipe's container image, :latest where it names no tag or digest."""
    container = (rec.container or "").strip()
    if not container:
        raise pos.error(("container",) if "container" in data else (), "the recipe names no container image",
                        fix="add container: REPO:TAG")
    ref = ImageRef.parse(container)
    image = container if ref.tag is not None or ref.digest is not None else container + ":latest"
    if not IMAGE_RE.match(image):
        raise pos.error(("container",), f"container {container[:80]!r} is not an image reference",
                        fix="write it as registry/repo:tag (optionally @sha256:...)")
    return image


def _environment(rec: Any, problems: list[str], pos: Positions) -> dict[str, str]:
    """The recipe's environment, less what sparkprov sets itself (G22/G26/G31)."""
    env: dict[str, str] = {}
    for k, v in (rec.env or {}).items():
        if not _ENV_NAME.match(k):
            raise pos.error(("env", k), f"env {k[:40]!r} is not an environment variable name",
                            fix="use letters, digits and _", key=True)
        if v is None:
            problems.append(f"env {k} has no value: not imported")
        elif "\0" in _scalar(v):
            raise pos.error(("env", k), f"env {k} holds a NUL character, which no environment can carry",
                            fix="remove it")
        else:
            env[k] = _scalar(v)
    for k in ("HF_TOKEN", "VLLM_API_KEY", "HF_HOME"):
        if k in env:
            env.pop(k)
            problems.append(f"env {k} is sparkprov's to set (G22/G26/G31): removed")
    return env


def import_file(path: str | Path, *, alias: str | None = None, variant: str | None = None) -> Imported:
    """Read a foreign recipe (bounded, positioned) and convert it; every error an InputError."""
    data, pos = load_yaml(path, what="recipe to import")
    return convert(data, origin=str(path), alias=alias, variant=variant, pos=pos)


def lint_imported(text: str, alias: str, out_file: str | Path, *, flags_cache: str | None = None):
    """Load the user recipe text over the catalog as `out_file` will load once written (nothing is
    written here), render the launch of `alias` and run every G-rule."""
    from sparkprov.catalog.lint import lint_launch
    from sparkprov.catalog.load import load_catalog
    from sparkprov.catalog.render import HostServeContext, render_launch

    cat = load_catalog(unwritten=(str(out_file), text))
    r = cat.get(alias)
    launch = render_launch(r, HostServeContext(), min(r.tp_sizes), catalog=cat)
    return launch, lint_launch(launch, catalog=cat, flags_cache=flags_cache)
