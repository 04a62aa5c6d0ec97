"""The shipped inventory.yaml works on the lab as it is (issue 36): a newcomer's first command,
`invoke provision --hosts spark1,spark2` after `make demo`, ran fabric qualification against a
Spark's floor (46 Gb/s) on the lab's veth rails (6.4-9.2 Gb/s), recorded every rail degraded and
so refused the next multi-node cluster-up. What the lab needs is read from the lab itself: the rail
figures of sparklab/state.py LAB_RAIL_VARS and every line `invoke lab.up` writes into the lab's
own inventory (sparklab/up.py inventory_text), never a copy of them."""

from __future__ import annotations

from pathlib import Path

import yaml

from sparklab import state
from sparklab.state import LAB_RAIL_VARS, HostRecord, LabRecord
from sparklab.up import inventory_text
from sparkprov.data.inventory import load_inventory

SHIPPED = Path(__file__).resolve().parents[2] / "inventory.yaml"


def _lab_inventory() -> dict:
    """The inventory lab.up writes for its two hosts (the hub at its default address)."""
    rec = LabRecord(hosts={state.host_name(i): HostRecord(state.host_name(i), i, state.host_address(i))
                           for i in (1, 2)}, topology="p2p")
    return yaml.safe_load(inventory_text(rec, f"http://{state.BRIDGE_IP}:{state.HUB_PORT}"))


def test_the_shipped_inventory_carries_the_lab_rail_figures():
    inv = load_inventory(SHIPPED)
    assert LAB_RAIL_VARS, "the lab declares its rail figures"
    for name, host in inv.hosts.items():
        got = {k: host.vars.get(k) for k in LAB_RAIL_VARS}
        assert got == LAB_RAIL_VARS, f"{name}: {got} (the lab's veth rails need {LAB_RAIL_VARS})"


def test_the_shipped_inventory_has_every_host_and_var_the_lab_writes():
    lab = _lab_inventory()
    inv = load_inventory(SHIPPED)
    assert {n: h.address for n, h in inv.hosts.items()} == {n: h["address"] for n, h in lab["hosts"].items()}
    assert inv.groups == lab["groups"]
    for name, host in inv.hosts.items():
        for key, value in lab["defaults"].items():
            assert getattr(host, key) == value, f"{name}: {key} is {getattr(host, key)!r}, the lab's {value!r}"
        missing = {k: v for k, v in lab["vars"].items() if host.vars.get(k) != v}
        assert not missing, f"{name}: the lab's inventory has {missing}, the shipped one {host.vars}"


def test_the_rail_figures_are_said_to_be_the_labs():
    """The comment above them names them the lab's and tells a Spark owner to remove them (the lab's
    floor would pass a degraded 200G link)."""
    lines = SHIPPED.read_text().splitlines()
    for key in LAB_RAIL_VARS:
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {key}:"))
        comment = " ".join(line for line in lines[max(0, at - 5):at] if line.lstrip().startswith("#"))
        assert "LAB_RAIL_VARS" in comment and "real Sparks" in comment, comment


def test_the_catalog_commands_read_the_inventory_every_command_reads(tmp_path):
    """`invoke lint ALIAS --host H` and `invoke recipe ALIAS --host H` outside the checkout (the README
    test runs every example from a folder of its own): --inventory, $SPARKPROV_INVENTORY,
    ./inventory.yaml, else the repository's, as every other command; they read ./inventory.yaml
    alone before (a file not found)."""
    import os
    import subprocess

    repo = SHIPPED.parent
    env = {k: v for k, v in os.environ.items() if k != "SPARKPROV_INVENTORY"}
    for args in (["recipe", "lab-tiny", "--host", "spark1"], ["lint", "lab-tiny", "--host", "spark1"]):
        p = subprocess.run([str(repo / ".venv" / "bin" / "invoke"), "-r", str(repo), *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (args, p.stdout[-500:], p.stderr[-500:])


def test_every_image_the_shipped_inventory_and_the_readme_commands_name_is_one_lab_up_pushes():
    """`invoke monitor up` (prometheus_image), `invoke gateway up` (sparkprov's default gateway image)
    and provision's GPU smoke test (smoke_image) on the lab: lab.up and make demo push each
    (sparklab/image.py lab_images); before, monitor up and gateway up failed with docker's exit 125."""
    from sparklab.image import lab_images
    from sparkprov.serving.gateway import IMAGE as GATEWAY_IMAGE

    pushed = set(lab_images())
    named = {v for h in load_inventory(SHIPPED).hosts.values() for k, v in h.vars.items() if k.endswith("_image")}
    named |= {v for k, v in _lab_inventory()["vars"].items() if k.endswith("_image")}
    assert named and GATEWAY_IMAGE in pushed and named <= pushed, named - pushed
