"""The one deployment model (serving/deployment.py): a serve playbook's entry, cluster-up --model's
deployment and the serving modules' argument are one Deployment, checked once; its endpoint rule."""

from __future__ import annotations

import pytest
import yaml

from sparkprov.catalog.load import load_catalog
from sparkprov.data.inventory import load_inventory
from sparkprov.errors import InputError
from sparkprov.serving.deployment import Deployment, command_line_deployment, load_serve_playbook
from tests.fixtures.golden import make

INV = load_inventory(make.INVENTORY)


def _book(tmp_path, entry: dict) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"deployments": [entry]}, sort_keys=False))
    return str(path)


def test_a_playbook_entry_a_command_line_deployment_and_module_args_are_one_model(tmp_path):
    book = load_serve_playbook(_book(tmp_path, {"name": "pair", "model": "lab-tiny", "hosts": "spark1,spark2",
                                                "tp": 2, "executor": "native"}), INV)
    (from_file,) = book.deployments
    from_cli = command_line_deployment(INV, "lab-tiny", tp=2, pp=1, dp=1, ep=False, executor="native",
                                       hosts="spark1,spark2", name="pair", recipe_files=[])
    assert from_file.as_args() == from_cli.as_args()  # where they were written is not part of it
    assert from_file.where[0] == book.path and from_file.where[1] == 2 and from_cli.where[0] == "--model"
    back = Deployment.model_validate(from_file.as_args())  # what a serving module receives
    assert back.as_args() == from_file.as_args() and back.hosts == ["spark1", "spark2"] and back.nodes == 2


def test_the_executor_defaults_to_ray_and_to_native_with_replicas():
    assert Deployment(name="a", model="lab-tiny", hosts=["spark1", "spark2"], tp=2).executor == "ray"
    assert Deployment(name="a", model="lab-tiny", hosts=["spark1", "spark2"], dp=2).executor == "native"


@pytest.mark.parametrize("key", ["image_override", "pin", "recipe_files", "where"])
def test_keys_sparkprov_sets_are_refused_in_a_playbook_at_their_line(tmp_path, key):
    entry = {"name": "one", "model": "lab-tiny", "hosts": "spark1", key: "x"}
    with pytest.raises(InputError) as e:
        load_serve_playbook(_book(tmp_path, entry), INV)
    assert e.value.lineno == 5 and f"{key} is not a key of a deployment" in e.value.message


def test_the_hosts_must_carry_the_layout_g35(tmp_path):
    with pytest.raises(InputError, match=r"tp 2 needs exactly 2 hosts \(one GPU per Spark, G35\), hosts gives 3"):
        load_serve_playbook(_book(tmp_path, {"name": "t", "model": "lab-tiny", "hosts": "spark1,spark2,spark3",
                                             "tp": 2}), INV)
    three = Deployment(name="t", model="lab-tiny", hosts=["spark1", "spark2", "spark3"], tp=2)
    with pytest.raises(InputError, match="G35"):
        three.check(load_catalog())


def test_a_command_line_deployment_has_the_same_host_rule_g35():
    """--model takes the inventory's first hosts without --hosts; --hosts of another count is refused
    with the words a playbook's deployment gets, naming the hosts."""
    first = command_line_deployment(INV, "lab-tiny", tp=2, pp=1, dp=1, ep=False, executor=None, hosts=None,
                                    name=None, recipe_files=[])
    assert first.hosts == list(INV.hosts)[:2] and first.name == "lab-tiny"
    with pytest.raises(InputError) as e:
        command_line_deployment(INV, "lab-tiny", tp=2, pp=1, dp=1, ep=False, executor=None,
                                hosts="spark1,spark2,spark3", name=None, recipe_files=[])
    assert e.value.line() == ("--model: deployment 'lab-tiny': tp 2 needs exactly 2 hosts (one GPU per Spark, G35), "
                              "hosts gives 3: spark1, spark2, spark3 (fix: give 2 hosts, the first is rank 0)")
    with pytest.raises(InputError, match="runs at tp 1"):  # the recipe's sizes come before the host count
        command_line_deployment(INV, "qwen3.6-27b", tp=2, pp=1, dp=1, ep=False, executor=None, hosts="spark1",
                                name=None, recipe_files=[])


def test_one_endpoint_rule():
    d = Deployment(name="a", model="lab-tiny", hosts=["spark1"])
    assert d.endpoint({}, "10.0.0.11") == "http://10.0.0.11:8000"  # 0.0.0.0: the address the host is reached at
    assert d.endpoint({"serve_bind": "::", "serve_port": 8010}, "10.0.0.11") == "http://10.0.0.11:8010"
    assert d.endpoint({"serve_bind": "127.0.0.1"}, "10.0.0.11") == "http://127.0.0.1:8000"
    assert d.model_copy(update={"port": 8123}).endpoint({"serve_port": 8010}, "h") == "http://h:8123"
