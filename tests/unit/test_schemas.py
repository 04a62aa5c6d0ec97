"""The published JSON Schemas are what the code generates, and the shipped files satisfy them;
bad files the loaders reject are rejected by the schemas too (the editor sees what sparkprov sees)."""

from pathlib import Path

import jsonschema
import pytest
import yaml

from sparkprov.data.schema import SCHEMA_DIR, inventory_schema, playbook_schema, render

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,make", [("inventory", inventory_schema), ("playbook", playbook_schema)])
def test_published_schema_is_current(name, make):
    published = (SCHEMA_DIR / f"{name}.schema.json").read_text()
    assert published == render(make()), f"run `invoke schema` to refresh schemas/{name}.schema.json"


@pytest.mark.parametrize("path", ["inventory.yaml"])
def test_shipped_inventory_validates(path):
    jsonschema.validate(yaml.safe_load((REPO / path).read_text()), inventory_schema())


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "playbooks").glob("provision.yaml"))
                         + ["tests/fixtures/playbooks/files.yaml", "bench/work/sparkprov.yaml"])
def test_shipped_playbooks_validate(path):
    jsonschema.validate(yaml.safe_load((REPO / path).read_text()), playbook_schema())


@pytest.mark.parametrize("path", ["unknown_key.yaml", "bad_port.yaml", "bad_connection.yaml"])
def test_schema_rejects_what_the_loader_rejects_inventory(path):
    data = yaml.safe_load((REPO / "tests/fixtures/bad/inventory" / path).read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, inventory_schema())


@pytest.mark.parametrize("path", ["unknown_module.yaml", "bad_arg.yaml", "no_hosts.yaml", "args_not_mapping.yaml"])
def test_schema_rejects_what_the_loader_rejects_playbook(path):
    data = yaml.safe_load((REPO / "tests/fixtures/bad/playbook" / path).read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, playbook_schema())


def test_readme_lists_every_inventory_variable_as_generated():
    """The README's list of inventory variables is the declaration's (sparkprov/inventory_vars.py),
    as `invoke schema` writes it."""
    from sparkprov.data.schema import README, readme_with_variables
    from sparkprov.inventory_vars import VARS

    text = README.read_text()
    assert text == readme_with_variables(text), "run `invoke schema` to refresh the README's list of variables"
    for name in VARS:
        assert f"| `{name}` |" in text


def test_schema_types_the_declared_variables_and_keeps_the_users_own():
    schema = inventory_schema()
    ok = {"hosts": {"s1": {"vars": {"serve_port": 8000, "my_own": {"any": "thing"}}}}}
    jsonschema.validate(ok, schema)
    for bad in ({"serve_port": "8000; id"}, {"host_memory_gib": "lots"}, {"guard_act": "yes"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"vars": bad}, schema)
