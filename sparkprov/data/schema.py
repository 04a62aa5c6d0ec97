"""JSON Schemas for inventory and playbook files, so editors can complete and check them.

Generated from the same pydantic models the loaders validate with (the modules' Args included),
written to schemas/ by `invoke schema`, which also writes the README's list of inventory variables
from their declaration (sparkprov/inventory_vars.py); tests keep both equal to what the code
generates. In VS Code (YAML extension), put this first line in a file:

    # yaml-language-server: $schema=../schemas/playbook.schema.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"
DRAFT = "https://json-schema.org/draft/2020-12/schema"


def inventory_schema() -> dict[str, Any]:
    """The inventory's schema; every `vars:` mapping lists the declared variables
    (sparkprov/inventory_vars.py), and still takes variables of the user's own."""
    from sparkprov.data.inventory import InventoryFile
    from sparkprov.inventory_vars import json_schema_properties

    schema = InventoryFile.model_json_schema()
    schema.update({"$schema": DRAFT, "title": "sparkprov inventory"})
    variables = {"$ref": "#/$defs/variables"}
    schema["properties"]["vars"] = variables
    for name in ("GroupEntry", "HostEntry"):
        schema["$defs"][name]["properties"]["vars"] = variables
    schema["$defs"]["variables"] = {"type": "object", "additionalProperties": True,
                                    "properties": json_schema_properties(),
                                    "description": "inventory variables: the ones sparkprov reads, and your own"}
    return schema


def playbook_schema() -> dict[str, Any]:
    from sparkprov import modules
    from sparkprov.data.playbook import TASK_KEYWORDS, _PlayFile, _TaskKeywords

    defs: dict[str, Any] = {}
    keywords = _TaskKeywords.model_json_schema()
    task_variants = []
    for name, module in sorted(modules.registry().items()):
        args = module.Args.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(args.pop("$defs", {}))
        args["description"] = (module.doc or name).strip()
        defs[f"args_{name}"] = args
        props = {k: v for k, v in keywords["properties"].items()}
        props[name] = {"anyOf": [{"$ref": f"#/$defs/args_{name}"}, {"type": "null"}]}
        task_variants.append({"type": "object", "properties": props, "required": [name],
                              "additionalProperties": False, "title": name})
    play = _PlayFile.model_json_schema()
    play["properties"]["tasks"] = {"type": "array", "items": {"$ref": "#/$defs/task"}}
    play["properties"]["handlers"] = {"type": "array", "items": {"$ref": "#/$defs/task"}}
    play.pop("title", None)
    defs["task"] = {"oneOf": task_variants,
                    "description": "one module (its name as the key) plus keywords: " + ", ".join(sorted(TASK_KEYWORDS))}
    defs["play"] = play
    return {"$schema": DRAFT, "title": "sparkprov playbook", "type": "array", "minItems": 1,
            "items": {"$ref": "#/$defs/play"}, "$defs": defs}


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


README = SCHEMA_DIR.parent / "README.md"


def readme_with_variables(text: str) -> str:
    """The README's text with its list of inventory variables generated again from the
    declaration (between inventory_vars.README_BEGIN and README_END)."""
    from sparkprov.inventory_vars import README_BEGIN, README_END, readme_table

    head, begin, rest = text.partition(README_BEGIN)
    _, end, tail = rest.partition(README_END)
    if not begin or not end:
        raise ValueError(f"README.md has no {README_BEGIN} ... {README_END} section")
    return head + readme_table() + tail


def write_schemas(directory: Path = SCHEMA_DIR, readme: Path = README) -> list[Path]:
    """schemas/*.schema.json and the README's list of inventory variables."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in (("inventory", inventory_schema()), ("playbook", playbook_schema())):
        path = directory / f"{name}.schema.json"
        path.write_text(render(schema))
        written.append(path)
    text = readme.read_text()
    new = readme_with_variables(text)
    if new != text:
        readme.write_text(new)
        written.append(readme)
    return written
