"""The declaration of inventory variables (sparkprov/inventory_vars.py): every variable sparkprov
reads is declared, readers read through it, the inventory is checked against it when loaded.

The hostile command lines for these (issue 33: `invoke plan` on `host_memory_gib: lots`, the
guard's settings, `monitor_host`, `fabric_ip` with `;` ...) are tests/fixtures/hostile/cli/vars_*.yaml,
run through the real CLI by test_inputs_hostile_cli.py."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from sparkprov import inventory_vars as iv
from sparkprov.catalog.render import HostServeContext
from sparkprov.data.inventory import load_inventory
from sparkprov.errors import InputError
from sparkprov.node import settings as guard_settings

SRC = Path(iv.__file__).resolve().parent
INV = "defaults: {port: 9}\nhosts:\n  s1: {address: 127.0.0.1}\n  s2: {address: 127.0.0.1}\ngroups:\n  g: [s1]\n"


def load(tmp_path, text: str):
    p = tmp_path / "inv.yaml"
    p.write_text(text)
    return load_inventory(p)


def refusal(tmp_path, text: str) -> str:
    with pytest.raises(InputError) as err:
        load(tmp_path, text)
    return err.value.line()


@pytest.mark.parametrize("name", sorted(iv.VARS))
def test_every_default_is_what_its_variable_accepts(name):
    var = iv.VARS[name]
    assert var.doc and var.source and var.readers and var.kind.accepts
    if var.default is not None:
        assert var.kind.check(var.default) == var.default


def _names_read(text: str) -> set[str]:
    """String literals naming a variable in calls of the readers: iv.value/given/setting/default,
    and the plain names setting (modules/_provision.py) and default where a file imports them."""
    plain = {n for n in ("setting", "default") if f"import {n}" in text or f", {n}" in text and "inventory_vars" in text}
    out = set()
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        ours = (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("iv", "inventory_vars")
                and f.attr in ("value", "given", "setting", "default")) or (isinstance(f, ast.Name) and f.id in plain)
        last = node.args[-1]
        if ours and isinstance(last, ast.Constant) and isinstance(last.value, str):
            out.add(last.value)
    return out


def test_every_variable_the_code_reads_is_declared_and_none_is_read_around_it():
    read, around = set(), []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        read |= _names_read(text)
        for n, line in enumerate(text.splitlines(), 1):
            # a variable read with its own .get() or [] skips the declaration's check and default
            if ("vars.get(" in line or 'vars["' in line or "vars['" in line) and path.name != "inventory_vars.py" \
                    and 'vars.get("groups")' not in line:
                around.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert read - set(iv.VARS) == set(), "read but not declared"
    assert {"model_store", "host_memory_gib", "guard_port", "prometheus_scrape_interval", "fabric_ip"} <= read
    assert around == []


def test_guard_settings_are_built_from_the_guards_own_table():
    guard = {v.name: v for v in iv.guard_variables()}
    assert guard and all(n.startswith("guard_") for n in guard)
    for name, var in guard.items():
        assert var.default == guard_settings.DEFAULTS[name[len("guard_"):]]
    assert sorted(guard) == sorted(f"guard_{name}" for name in guard_settings.NAMES)
    assert guard["guard_mem_free_floor_gib"].kind.accepts == "a number from 0.25 to 64 (GiB)"


@pytest.mark.parametrize("name,bad", [
    ("host_memory_gib", "lots"), ("host_memory_gib", math.nan), ("host_memory_gib", -1), ("host_memory_gib", True),
    ("max_gpu_memory_utilization", 1.5), ("max_gpu_memory_utilization", 0), ("guard_interval_s", math.inf),
    ("guard_mem_samples", 2.5), ("guard_mem_samples", "3"), ("guard_act", "yes"), ("serve_port", 0),
    ("fabric_ip", "10.0.0.1;id"), ("fabric_ip", "spark1"), ("fabric_ifaces", {"a": "b"}), ("fabric_ifaces", "a b/c"),
    ("fabric_ifaces", "x" * 16), ("fabric_ifaces", ["-v"]), ("ib_hcas", "rocep1s0f1;id"), ("model_store", "~bob/x"),
    ("model_store", "x/y"), ("model_store", "/srv/../etc"), ("model_store", "~"), ("model_store", "/"),
    ("compile_cache", "/a\rb"), ("prometheus_scrape_interval", "15s\nx"), ("prometheus_scrape_interval", "15"),
    ("guard_fatal_xids", [48, "79"]), ("smoke_command", ["nvidia-smi", "\n"]), ("fabric_subnets", ["10.0.0.0"]),
])
def test_a_value_its_declaration_refuses_is_one_line_naming_it_and_what_it_accepts(name, bad):
    with pytest.raises(iv.VarError) as err:
        iv.value({name: bad}, name)
    line = err.value.line()
    assert line.startswith(f"{name}: ") and "(fix: " in line and len(line.splitlines()) == 1, line


def test_values_are_read_as_declared_unset_is_the_default():
    assert iv.value({}, "serve_port") == 8000 and iv.value({"serve_port": None}, "serve_port") == 8000
    assert iv.value({"fabric_ifaces": "enp1s0f1np1,enP2p1s0f1np1"}, "fabric_ifaces") == ["enp1s0f1np1", "enP2p1s0f1np1"]
    assert iv.value({"ib_hcas": "rocep1s0f1 roceP2p1s0f1:1"}, "ib_hcas") == ["rocep1s0f1", "roceP2p1s0f1:1"]
    assert iv.value({"guard_mem_samples": 3.0}, "guard_mem_samples") == 3
    assert iv.value({"guard_interval_s": 5}, "guard_interval_s") == 5.0
    assert iv.value({"api_key_file": ""}, "api_key_file") == ""
    assert iv.setting(7, {"fabric_host_id": 9}, "fabric_host_id") == 7
    assert iv.given({}, "prometheus_image") is None and iv.value({}, "prometheus_image") == "prom/prometheus:v3.5.0"


def test_the_inventory_is_checked_at_the_line_that_writes_the_value(tmp_path):
    line = refusal(tmp_path, INV + "  g2:\n    hosts: [s2]\n    vars: {host_memory_gib: lots}\n")
    assert line == (f"{tmp_path}/inv.yaml:9:29: host_memory_gib: 'lots' is not a number "
                    "(fix: give a number above 0 and at most 1024 (GiB))")


def test_a_variable_of_the_users_own_is_kept_a_near_miss_is_named(tmp_path):
    inv = load(tmp_path, INV + "vars:\n  my_cluster_name: blue\n  store: x\n  serve: yes\n")
    assert inv.hosts["s1"].vars["my_cluster_name"] == "blue"
    assert refusal(tmp_path, INV + "vars:\n  fabric_iface: enp1s0f1np1\n") == (
        f"{tmp_path}/inv.yaml:8:3: unknown variable 'fabric_iface' (fix: did you mean 'fabric_ifaces'? (a variable "
        "of your own must not be this close to one of sparkprov's: rename it))")
    # every guard_ name is the guard's: one it does not have is named with the closest it has
    assert "unknown variable 'guard_restarts' (fix: did you mean 'guard_" in refusal(tmp_path, INV + "vars:\n  guard_restarts: 3\n")


def test_a_host_of_the_inventory_and_the_rail_figures_in_order(tmp_path):
    assert "monitor_host: 's9' is not a host of this inventory" in refusal(tmp_path, INV + "vars:\n  monitor_host: s9\n")
    assert load(tmp_path, INV + "vars:\n  gateway_host: s2\n").hosts["s1"].vars["gateway_host"] == "s2"
    # fabric_qualify's rule, before any rail is measured: at the floor's line (s1's expected comes from group g)
    group_sets_expected = INV.replace("  g: [s1]\n", "  g:\n    hosts: [s1]\n    vars: {rail_expected_gbps: 40}\n")
    line = refusal(tmp_path, group_sets_expected + "vars:\n  rail_min_gbps: 46\n")
    assert line == (f"{tmp_path}/inv.yaml:10:18: rail_min_gbps 46 is above rail_expected_gbps 40 for host s1 "
                    "(fix: the floor must be the lower figure)")


def test_a_launch_gets_the_host_variables_as_declared():
    ctx = HostServeContext.from_host_vars("s1", {"fabric_ifaces": "enp1s0f1np1,enP2p1s0f1np1", "fabric_ip": "10.0.0.1",
                                                 "model_store": "~/models"}, home="/home/nvidia")
    assert ctx.fabric_ifaces == ["enp1s0f1np1", "enP2p1s0f1np1"] and ctx.model_store == "/home/nvidia/models"
    with pytest.raises(InputError, match="fabric_ip: '10.0.0.1;id' is not an IP address"):
        HostServeContext.from_host_vars("s1", {"fabric_ip": "10.0.0.1;id"}, home="/home/nvidia")
