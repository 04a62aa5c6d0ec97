"""Load the catalog: the package's recipes/*.yaml, then users' files on top.

A user file has the same shape as the package's (`images:` and `recipes:`). A recipe whose alias
already exists replaces it; with `extends: OTHER` it starts from OTHER and overrides fields
(mappings merge key by key, lists replace, `add_args` / `remove_args` / `remove_env` edit the
inherited flags and env). `extends:` may name the recipe's own alias to build on the definition
it replaces. Errors in a file are one line: `FILE:LINE:COL: message (fix: ...)`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from pydantic import Field

from sparkprov.catalog.models import (NESTED, REQUIRED, DockerOpts, Image, Recipe, ResolvedRecipe, SmokeSpec, Source,
                                      Startup, Strict)
from sparkprov.errors import InputError
from sparkprov.imageref import IMAGE_RE, ImageRef
from sparkprov.yamlpos import Positions, load_yaml, parse_model

RECIPES_DIR = Path(__file__).with_name("recipes")


class CatalogFile(Strict):
    images: list[Image] = Field(default_factory=list)
    recipes: list[Recipe] = Field(default_factory=list)


@dataclass
class _Entry:
    recipe: Recipe
    file: str
    pos: Positions
    path: tuple
    previous: "_Entry | None" = None  # the definition this one replaced (for self-extends)

    def error(self, message: str, *, key: str | None = None, fix: str | None = None) -> InputError:
        p = self.path + ((key,) if key else ())
        return self.pos.error(p, f"recipe {self.recipe.alias!r}: {message}", fix=fix, key=bool(key))


@dataclass(frozen=True)
class RepoInfo:
    """A Hugging Face repo the catalog needs staged (the lab's hub serves these)."""

    repo: str
    revision: str
    size_gb: float | None
    gated: bool
    purpose: str  # model | drafter | tokenizer | assistant | file
    config: dict | None = None  # config.json values for a fake checkpoint
    files: tuple[str, ...] = ()  # extra files the catalog fetches from it (reasoning-parser plugins)
    used_by: tuple[str, ...] = ()


@dataclass
class Catalog:
    recipes: dict[str, ResolvedRecipe]
    image_table: dict[str, Image]
    files: list[str] = field(default_factory=list)

    def get(self, alias: str) -> ResolvedRecipe:
        if alias not in self.recipes:
            close = difflib.get_close_matches(alias, list(self.recipes), n=1)
            raise InputError(f"unknown model alias {alias!r}",
                             fix=f"did you mean {close[0]!r}?" if close else "run `invoke models` for the list")
        return self.recipes[alias]

    def image(self, ref: str) -> Image | None:
        return self.image_table.get(ImageRef.parse(ref).tagged)

    def reference(self, ref: str) -> str:
        """The reference a recipe's image `ref` runs by: with the catalog's digest where it records
        one (a reference that names its own digest, or an image the catalog does not list: as it is)."""
        img = self.image(ref)
        return img.pinned if img is not None and ImageRef.parse(ref).digest is None else ref

    def images(self) -> set[str]:
        """Every image a recipe uses, with its digest where the catalog knows it."""
        return {self.reference(r.image) for r in self.recipes.values()}

    def repos(self) -> list[RepoInfo]:
        """Every repo a recipe reads: the model, drafters/tokenizers, repos of staged files."""
        found: dict[tuple[str, str], dict[str, Any]] = {}

        def add(repo: str, revision: str, alias: str, **kw: Any) -> None:
            entry = found.setdefault((repo, revision), {"repo": repo, "revision": revision, "size_gb": None,
                                                        "gated": False, "purpose": kw.get("purpose", "model"),
                                                        "config": None, "files": set(), "used_by": set()})
            entry["used_by"].add(alias)
            if kw.get("size_gb") is not None and entry["size_gb"] is None:
                entry["size_gb"] = kw["size_gb"]
            entry["gated"] = entry["gated"] or bool(kw.get("gated"))
            if kw.get("config") is not None and entry["config"] is None:
                entry["config"] = kw["config"]
            entry["files"].update(kw.get("files", ()))

        for r in self.recipes.values():
            add(r.model.repo, r.model.revision, r.alias, size_gb=r.size_gb, gated=r.gated, purpose="model",
                config=r.config.hf_config() if r.config else None)
            for x in r.extra_repos:
                add(x.repo, x.revision, r.alias, size_gb=x.size_gb, gated=x.gated, purpose=x.purpose)
            for s in r.stage:
                add(s.repo, s.revision, r.alias, purpose="model" if s.repo == r.model.repo else "file",
                    files=(s.filename,))
        return [RepoInfo(repo=e["repo"], revision=e["revision"], size_gb=e["size_gb"], gated=e["gated"],
                         purpose=e["purpose"], config=e["config"], files=tuple(sorted(e["files"])),
                         used_by=tuple(sorted(e["used_by"])))
                for e in sorted(found.values(), key=lambda e: (e["repo"], e["revision"]))]


# The fix for a value a recipe field's own rule refused (catalog/models.py says why), by field.
FIELD_FIXES = {
    "host": "give an absolute path, or one under the store ({model_store}/NAME or NAME), without '..', ':' or ','",
    "container": "give an absolute path in the container, without '..', ':' or ','",
    "repo": "give the repo id as the hub shows it: ORG/NAME",
    "revision": "give a branch, tag or commit of the repo, e.g. main",
    "path": "give an absolute path in the container, e.g. /models/NAME",
    "shm_size": "give a size such as 16gb or 64g",
    "ulimits": "write each as NAME=SOFT[:HARD], e.g. memlock=-1:-1",
    "image": "give registry/repo[:tag][@sha256:DIGEST], e.g. vllm/vllm-openai:v0.19.0",
    "alias": "use lowercase letters, digits, '.', '_' and '-'",
    "extends": "name a recipe of the catalog (invoke models) or of this file",
}


def package_files() -> list[Path]:
    return sorted(RECIPES_DIR.glob("*.yaml"))


def _read(path: Path | str, text: str | None = None) -> tuple[CatalogFile, Positions]:
    data, pos = load_yaml(path, text=text, what="recipe file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise pos.error((), "a recipe file is a mapping with `images:` and/or `recipes:`",
                        fix="start the file with `recipes:` and a list of recipes")
    return parse_model(CatalogFile, data, pos, fixes=FIELD_FIXES), pos


def _fill_sources(recipe: Recipe, default: Source) -> Recipe:
    """Give every flag, env value, mount, staged file and extra repo the recipe's source unless it
    names its own, so inherited values keep the source of the recipe that set them."""
    src = recipe.source or default

    def fill(items):
        return None if items is None else [i if i.source else i.model_copy(update={"source": src}) for i in items]

    update: dict[str, Any] = {}
    for name in ("args", "add_args", "mounts", "stage", "extra_repos"):
        value = getattr(recipe, name)
        if value is not None:
            update[name] = fill(value)
    if recipe.env is not None:
        update["env"] = {k: v if v.source else v.model_copy(update={"source": src}) for k, v in recipe.env.items()}
    if recipe.startup is not None and recipe.startup.get("source") is None:
        update["startup"] = {**recipe.startup, "source": src}
    if recipe.source is None:
        update["source"] = src
    return recipe.model_copy(update=update)


def _mounts_read_only_unless_said(recipe: Recipe) -> Recipe:
    """A user recipe's mount is read-only unless it says `read_only: false`: a recipe from
    elsewhere (an import, a colleague's file) should not get write access to a host path by
    leaving a key out."""
    if not recipe.mounts:
        return recipe
    mounts = [m if "read_only" in m.model_fields_set else m.model_copy(update={"read_only": True})
              for m in recipe.mounts]
    return recipe.model_copy(update={"mounts": mounts})


def _merge_model(parent: Any, child: Any) -> Any:
    """Child's keys over the parent's, mappings merged key by key (lists and values replace)."""
    if not isinstance(parent, dict) or not isinstance(child, dict):
        return child
    out = dict(parent)
    for key, value in child.items():
        out[key] = _merge_model(parent.get(key), value) if isinstance(value, dict) else value
    return out


INHERITED_SOURCED = ("model", "size_gb", "gated", "traits", "config", "kv_measured", "image", "command",
                     "pre_serve", "docker", "tp_sizes", "startup", "smoke")
MERGED_MODELS = ("model", "traits", "config", "kv_measured", "docker", "startup", "smoke")


def _apply(parent: dict[str, Any], child: Recipe, entry: _Entry) -> dict[str, Any]:
    out = dict(parent)
    for name in child.model_fields_set:
        if name in ("alias", "extends", "add_args", "remove_args", "remove_env", "lint_ignore"):
            continue
        value = getattr(child, name)
        if name in MERGED_MODELS:
            out[name] = None if value is None else _merge_model(out.get(name), value)
        elif name in ("env", "sources") and value is not None:
            out[name] = {**(out.get(name) or {}), **value}
        else:
            out[name] = value
    args = list(out.get("args") or [])
    for flag in child.remove_args:
        if not any(f.flag == flag for f in args):
            raise entry.error(f"remove_args names {flag}, which it does not have", key="remove_args",
                              fix=f"flags it has: {' '.join(f.flag for f in args) or 'none'}")
        args = [f for f in args if f.flag != flag]
    for new in child.add_args:
        for i, f in enumerate(args):
            if f.flag == new.flag:
                args[i] = new
                break
        else:
            args.append(new)
    if child.remove_args or child.add_args:
        out["args"] = args
    env = dict(out.get("env") or {})
    for name in child.remove_env:
        if name not in env:
            raise entry.error(f"remove_env names {name}, which it does not set", key="remove_env",
                              fix=f"variables it sets: {', '.join(env) or 'none'}")
        env.pop(name)
    if child.remove_env:
        out["env"] = env
    # lint_ignore is about this recipe's own reasons: inherited ones stay, the child's add to them
    out["lint_ignore"] = list(out.get("lint_ignore") or []) + list(child.lint_ignore)
    return out


def _resolve(alias: str, entries: dict[str, _Entry], stack: tuple[str, ...] = (),
             entry: _Entry | None = None) -> dict[str, Any]:
    entry = entry or entries[alias]
    r = entry.recipe
    if r.extends:
        if r.extends == alias:
            if entry.previous is None:
                raise entry.error("extends itself, but no earlier definition of it exists", key="extends",
                                  fix="extend another alias, or define it fully")
            base = _resolve(alias, entries, stack, entry.previous)
        else:
            if r.extends in stack or r.extends == alias:
                raise entry.error(f"extends {r.extends!r}, which extends it back ({' -> '.join(stack + (alias,))})",
                                  key="extends", fix="remove the cycle")
            if r.extends not in entries:
                close = difflib.get_close_matches(r.extends, list(entries), n=1)
                raise entry.error(f"extends unknown alias {r.extends!r}", key="extends",
                                  fix=f"did you mean {close[0]!r}?" if close else "run `invoke models` for the list")
            base = _resolve(r.extends, entries, stack + (alias,))
        base = dict(base)
        inherited = dict(base.get("sources") or {})
        for name in INHERITED_SOURCED:  # what the child does not set keeps the parent's source
            if name not in r.model_fields_set and base.get(name) is not None:
                inherited.setdefault(name, base["source"])
        base["sources"] = inherited
        base.pop("note_command", None)  # the parent's note command is not this recipe's
        base.pop("corrections", None)
        data = _apply(base, r, entry)
    else:
        data = _apply({}, r, entry)
    data["alias"] = alias
    data["extends"] = r.extends
    data["origin"] = entry.file
    return data


def _finish(data: dict[str, Any], entry: _Entry) -> ResolvedRecipe:
    for name, model in NESTED.items():  # validated now that `extends` has filled them in
        if data.get(name) is not None:
            data[name] = parse_model(model, data[name], entry.pos, prefix=entry.path + (name,), fixes=FIELD_FIXES)
    missing = [k for k in REQUIRED if data.get(k) is None]
    if missing:
        raise entry.error(f"has no {', '.join(missing)}",
                          fix=f"add {missing[0]}: ... or extends: an alias that has it")
    image = data["image"]
    if not IMAGE_RE.match(image):
        raise entry.error(f"image {image!r} is not a reference like repo/name:tag", key="image",
                          fix="write it as registry/repo:tag (optionally @sha256:...)")
    tp_sizes = data["tp_sizes"]
    resolved = {
        "title": data.get("title") or data["model"].repo,
        "config": data.get("config"),
        "kv_measured": data.get("kv_measured"),
        "command": data.get("command"),
        "pre_serve": data.get("pre_serve") or [],
        "env": data.get("env") or {},
        "docker": data.get("docker") or DockerOpts(),
        "mounts": data.get("mounts") or [],
        "stage": data.get("stage") or [],
        "extra_repos": data.get("extra_repos") or [],
        "startup": data.get("startup") or Startup(source=data["source"]),
        "smoke": data.get("smoke") or SmokeSpec(),
        "lint_ignore": data.get("lint_ignore") or [],
        "note_command": data.get("note_command"),
        "corrections": data.get("corrections") or [],
        "notes": data.get("notes") or [],
        "sources": data.get("sources") or {},
    }
    fields = {k: data.get(k) for k in ("alias", "extends", "origin", "source", "model", "size_gb", "gated", "traits",
                                   "image", "args")}
    fields["tp_sizes"] = sorted(set(tp_sizes))
    for f in data["args"]:
        if f.flag in ("--api-key",):
            raise entry.error("puts the API key in argv, where `docker inspect` and `ps` show it", key="args",
                              fix="remove --api-key: sparkprov passes the host's key file (G31)")
    return ResolvedRecipe(**fields, **resolved)


def load_catalog(extra_paths: Iterable[str | Path] = (), *, include_package: bool = True,
                 unwritten: tuple[str, str] | None = None) -> Catalog:
    """The package's recipes, then each user file in order (later files override earlier ones).
    `unwritten` is (NAME, TEXT): a user file that is not on disk yet, loaded last (what `recipe
    import` checks before it writes anything)."""
    images: dict[str, Image] = {}
    entries: dict[str, _Entry] = {}
    files: list[str] = []
    paths: list[tuple[Path | str, bool, str | None]] = [(p, True, None) for p in (package_files() if include_package else [])]
    paths += [(p, False, None) for p in extra_paths]
    if unwritten is not None:
        paths.append((unwritten[0], False, unwritten[1]))
    for path, builtin, text in paths:
        parsed, pos = _read(path, text)
        file = str(path)
        files.append(file)
        for i, img in enumerate(parsed.images):
            images[img.ref] = img
        seen: set[str] = set()
        for i, recipe in enumerate(parsed.recipes):
            where = ("recipes", i)
            if recipe.alias in seen:
                raise pos.error(where + ("alias",), f"alias {recipe.alias!r} is defined twice in this file",
                                fix="keep one, or give the other a new alias")
            seen.add(recipe.alias)
            default = Source(note="user" if not builtin else "sparkprov", where=Path(file).name)
            recipe = _fill_sources(recipe, default)
            if not builtin:
                recipe = _mounts_read_only_unless_said(recipe)
            entries[recipe.alias] = _Entry(recipe, file, pos, where, previous=entries.get(recipe.alias))
    recipes: dict[str, ResolvedRecipe] = {}
    for alias, entry in entries.items():
        data = _resolve(alias, entries)
        recipes[alias] = _finish(data, entry)
    return Catalog(recipes=dict(sorted(recipes.items())), image_table=images, files=files)
