"""YAML loading that remembers where every value came from.

Users get errors as `FILE:LINE:COL: message (fix: ...)`. PyYAML's composer gives every node a
start mark; we build plain Python data from the node tree and keep a side table from the path
of each value (a tuple of keys and indexes) to its position. A pydantic ValidationError's `loc`
is such a path, so it maps straight back to a line.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from sparkprov.errors import InputError

Path_ = tuple  # a path into the document: keys (str) and list indexes (int)


@dataclass
class Positions:
    """Where each value of a loaded document sits in its file."""

    file: str
    marks: dict[tuple, tuple[int, int]] = field(default_factory=dict)  # path -> (line, col), 1-based
    key_marks: dict[tuple, tuple[int, int]] = field(default_factory=dict)  # path of a key itself
    literal: set[tuple] = field(default_factory=set)  # paths of `|` block scalars: line k of the text is mark + 1 + k

    def at(self, path: Iterable, *, key: bool = False) -> tuple[int | None, int | None]:
        """Line and column of the value at `path`, or of its closest ancestor we know."""
        p = tuple(path)
        while True:
            table = self.key_marks if key and p in self.key_marks else self.marks
            if p in table:
                return table[p]
            if not p:
                return None, None
            p = p[:-1]
            key = False

    def error(self, path: Iterable, message: str, *, fix: str | None = None, key: bool = False) -> InputError:
        line, col = self.at(path, key=key)
        return InputError(message, file=self.file, line=line, column=col, fix=fix)

    def error_in(self, path: Iterable, text: str, needle: str, message: str, *, fix: str | None = None) -> InputError:
        """An error at the line of `text` (the value at `path`) where `needle` first appears: exact in a
        `|` block, else the line the value starts on."""
        p = tuple(path)
        line, col = self.at(p)
        if p in self.literal and line and needle and needle in text:
            line, col = line + 1 + text[:text.index(needle)].count("\n"), None
        return InputError(message, file=self.file, line=line, column=col, fix=fix)

    def sub(self, prefix: Iterable) -> "Positions":
        """Positions of a sub-document, re-rooted at `prefix`."""
        pre = tuple(prefix)
        n = len(pre)
        out = Positions(self.file)
        out.marks = {k[n:]: v for k, v in self.marks.items() if k[:n] == pre}
        out.key_marks = {k[n:]: v for k, v in self.key_marks.items() if k[:n] == pre}
        out.literal = {k[n:] for k in self.literal if k[:n] == pre}
        return out


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


# Aliases let a few lines expand into billions of values ("billion laughs"); no inventory or
# playbook comes near these.
MAX_VALUES = 1_000_000
MAX_DEPTH = 100
_PLAIN_TAGS = {"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}


class _Builder:
    def __init__(self, file: str):
        self.pos = Positions(file)
        self.constructor = yaml.SafeLoader("")  # only used to resolve scalar values
        self.count = 0
        self.open: set[int] = set()  # collections being built: an alias to one of them is a cycle
        self.merged: dict[int, int] = {}  # mapping node -> how many of its entries came from merge keys

    def build(self, node: yaml.Node, path: tuple) -> Any:
        self.count += 1
        if self.count > MAX_VALUES:
            line, col = _mark(node)
            raise InputError(f"the document expands to more than {MAX_VALUES} values (YAML aliases)",
                             file=self.pos.file, line=line, column=col, fix="write the values out instead of aliasing")
        if id(node) in self.open:
            line, col = _mark(node)
            raise InputError("a YAML alias refers to a collection that contains it", file=self.pos.file,
                             line=line, column=col, fix="remove the recursive alias")
        if len(path) > MAX_DEPTH:
            line, col = _mark(node)
            raise InputError(f"nested more than {MAX_DEPTH} levels deep", file=self.pos.file,
                             line=line, column=col, fix="flatten the structure")
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            self.open.add(id(node))
            try:
                return self._build(node, path)
            finally:
                self.open.discard(id(node))
        return self._build(node, path)

    def _build(self, node: yaml.Node, path: tuple) -> Any:
        self.pos.marks[path] = _mark(node)
        if isinstance(node, yaml.CollectionNode) and node.tag not in _PLAIN_TAGS:
            # (a scalar with a tag the SafeLoader does not know is refused when it is constructed)
            raise self.pos.error(path, f"unsupported YAML tag {node.tag!r}", fix="remove the tag")
        if isinstance(node, yaml.MappingNode):
            out: dict = {}
            # `<<: *base` merges put the base's entries before the mapping's own ones, and a key of
            # the mapping's own overrides a merged one: that is what merge keys are for, not a
            # duplicate. Only two own keys with the same name are. flatten_mapping rewrites the
            # node in place, so the count is kept per node for an alias built a second time.
            if id(node) not in self.merged:
                own = sum(1 for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge")
                self.constructor.flatten_mapping(node)
                self.merged[id(node)] = len(node.value) - own
            n_merged = self.merged[id(node)]
            own_keys: set = set()
            for i, (key_node, value_node) in enumerate(node.value):
                key = self.build(key_node, path + ("<key>",))
                if not isinstance(key, (str, int, float, bool)) or key is None:
                    raise self.pos.error(path + ("<key>",), "a mapping key must be a plain value")
                if i < n_merged:
                    # two merged bases with one key: PyYAML lays the later-listed base first, so
                    # the last entry here is the first listed, which wins, as in PyYAML
                    pass
                elif key in own_keys:
                    line, col = _mark(key_node)
                    raise InputError(f"duplicate key {key!r}", file=self.pos.file, line=line,
                                     column=col, fix="keep one of the two entries")
                else:
                    own_keys.add(key)
                    out.pop(key, None)  # overrides a merged entry; keep the file's order
                self.pos.key_marks[path + (key,)] = _mark(key_node)
                out[key] = self.build(value_node, path + (key,))
            self.pos.marks.pop(path + ("<key>",), None)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        if isinstance(node, yaml.ScalarNode) and node.style == "|":
            self.pos.literal.add(path)
        return self.constructor.construct_object(node, deep=True)


def load_yaml(path: str | Path, *, text: str | None = None, what: str = "",
              max_bytes: int | None = None) -> tuple[Any, Positions]:
    """Load one YAML document; raise InputError with the position on any syntax problem. The
    file is checked to be a regular file of sane size first (a FIFO would block, /dev/zero would
    be read forever; max_bytes, default MAX_YAML, bounds it); `what` ("inventory", "playbook")
    names it in those messages."""
    from sparkprov.inputfiles import MAX_YAML, read_text_checked

    file = str(path)
    if text is None:
        text = read_text_checked(path, what or "YAML file", max_bytes or MAX_YAML)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:  # PyYAML's composer recurses once per level of nesting
        raise _too_deep(text, file) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (control characters)
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        what = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise InputError(f"invalid YAML: unacceptable character #x{what:04x}: {exc.reason}", file=file,
                         line=line, column=column, fix="remove it or write it as an escape in a double-quoted string") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        fix = "check indentation and quoting near this position"
        if (exc.context_mark and exc.context and exc.context.startswith("while scanning a quoted scalar")
                and ("end of stream" in problem or "document separator" in problem)):
            # PyYAML reports where it gave up (often the end of the file); the user needs the
            # line where the quote was opened
            mark, problem = exc.context_mark, "a quoted string starting here is never closed"
            fix = "close the quote on this line"
        raise InputError(f"invalid YAML: {problem}", file=file,
                         line=mark.line + 1 if mark else None,
                         column=mark.column + 1 if mark else None, fix=fix) from None
    except yaml.YAMLError as exc:  # pragma: no cover - composer errors are all marked
        raise InputError(f"invalid YAML: {exc}", file=file) from None
    if node is None:
        return None, Positions(file)
    builder = _Builder(file)
    try:
        data = builder.build(node, ())
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        raise InputError(f"invalid YAML value: {exc.problem}", file=file,
                         line=mark.line + 1 if mark else None,
                         column=mark.column + 1 if mark else None) from None
    return data, builder.pos


def _too_deep(text: str, file: str) -> InputError:
    """Where nesting first goes past MAX_DEPTH (the event parser does not recurse)."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    m = event.start_mark
                    return InputError(f"nested more than {MAX_DEPTH} levels deep", file=file, line=m.line + 1,
                                      column=m.column + 1, fix="flatten the structure")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        pass
    return InputError(f"nested more than {MAX_DEPTH} levels deep", file=file, fix="flatten the structure")


def _describe(err: dict, model: type[BaseModel] | None) -> tuple[str, str | None]:
    """A short message and a fix for one pydantic error entry."""
    kind = err.get("type", "")
    loc = err.get("loc", ())
    field_name = loc[-1] if loc else ""
    if kind == "extra_forbidden":
        known = _known_fields(model, loc[:-1]) if model else []
        close = difflib.get_close_matches(str(field_name), known, n=1)
        fix = f"did you mean {close[0]!r}?" if close else (
            f"allowed keys: {', '.join(sorted(known))}" if known else "remove it")
        return f"unknown key {field_name!r}", fix
    if kind == "missing":
        return f"missing required key {field_name!r}", f"add {field_name}: ..."
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    where = f"{field_name}: " if isinstance(field_name, str) and field_name else ""
    return where + msg, None


def _known_fields(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """Field names allowed at `loc` inside `model`, following fields, dict values and list items."""
    current: Any = model
    for part in loc:
        current = _step(current, part)
        if current is None:
            return []
    current = _unwrap_model(current)
    if current is None:
        return []
    return [info.alias or name for name, info in current.model_fields.items()]


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _unwrap_model(t: Any) -> Any:
    """The model class of an annotation that is a model or an Optional/Union holding one."""
    if _is_model(t):
        return t
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        for arg in typing.get_args(t):
            if _is_model(arg):
                return arg
    return None


def _step(t: Any, part: Any) -> Any:
    """The annotation one step down from `t` along `part` (a field name, dict key or index)."""
    model = _unwrap_model(t)
    if model is not None and isinstance(part, str) and part in model.model_fields:
        return model.model_fields[part].annotation
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(t):
            found = _step(arg, part)
            if found is not None:
                return found
        return None
    if origin is dict:
        return typing.get_args(t)[1]
    if origin in (list, tuple, set):
        return typing.get_args(t)[0]
    if model is not None and isinstance(part, str):  # pydantic names a union member by its class
        return model if part == model.__name__ else None
    return None


def validation_error(exc: ValidationError, pos: Positions, *, model: type[BaseModel] | None = None,
                     prefix: tuple = (), fixes: dict[str, str] | None = None) -> InputError:
    """The first error of a ValidationError as one positioned InputError. `fixes`: the fix for a
    value refused by a field's own validator, by the field's name (pydantic's message has none)."""
    err = exc.errors()[0]
    loc = tuple(p for p in err.get("loc", ()) if not (isinstance(p, str) and p.startswith("function-")))
    message, fix = _describe(err, model)
    if fix is None and fixes:
        fix = fixes.get(next((p for p in reversed(loc) if isinstance(p, str)), ""))
    return pos.error(_data_path(pos, prefix, loc), message, fix=fix, key=err.get("type") == "extra_forbidden")


def _data_path(pos: Positions, prefix: tuple, loc: tuple) -> tuple:
    """pydantic names the member of a union it tried (`GroupEntry`, `list[str]`) inside `loc`;
    those are not keys of the document, so drop them."""
    path = tuple(prefix)
    for part in loc:
        candidate = path + (part,)
        known = candidate in pos.marks or candidate in pos.key_marks
        looks_like_type = isinstance(part, str) and (part[:1].isupper() or "[" in part)
        if known or not looks_like_type:
            path = candidate
    return path


def parse_model(model: type[BaseModel], data: Any, pos: Positions, *, prefix: tuple = (),
                context: dict | None = None, fixes: dict[str, str] | None = None):
    """Validate `data` (at `prefix` in the document) into `model`, errors pointing at the file."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise validation_error(exc, pos, model=model, prefix=prefix, fixes=fixes) from None
