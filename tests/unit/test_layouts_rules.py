"""The layout rules of issue 23 on literal data: tp x pp x dp (+ep) against the recipe, the image and
the hosts (catalog/layout.py); native data-parallel ranks (serving/spec.py); overrides may not set
a size against the layout; G35 counts dp; every VLLM_* variable against the image's vLLM (G4).
The real vLLM's parser accepting every render is tests/lab/test_real_layouts.py."""

from __future__ import annotations

import json

import pytest
from invoke import Exit

from sparkprov.catalog.knownflags import FlagSet, load_recorded
from sparkprov.catalog.layout import (Layout, check_layout, layout_of, layouts, override_conflicts,
                                      unverified_executor)
from sparkprov.catalog.lint import ERROR, lint_launch
from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch
from sparkprov.errors import InputError
from sparkprov.serving import node, spec, supervise
from sparkprov.serving.deployment import Deployment
from helpers import one, user

CAT = load_catalog()
FABRIC = {"spark1": "192.168.100.11", "spark2": "192.168.100.12"}


def refused(alias: str, layout: Layout, **kw) -> str:
    with pytest.raises(InputError) as exc:
        layout_of(CAT.get(alias), CAT, layout, **kw)
    assert "\n" not in exc.value.line()
    return exc.value.line()


def test_layout_rules_refuse_what_cannot_run_in_one_line():
    assert "not on Ray" in refused("lab-tiny", Layout(1, 1, 2, executor="ray"))
    assert "one Spark (tp x pp = 1)" in refused("lab-tiny", Layout(2, 1, 2, executor="native"))
    assert "not a mixture-of-experts" in refused("lab-tiny", Layout(2, executor="native", ep=True))
    assert "nothing to split" in refused("qwen3-coder-next", Layout(1, 2, ep=True, executor="native"))
    assert "takes 2 Spark(s)" in refused("lab-tiny", Layout(1, 1, 2, executor="native"), hosts=3)
    assert "runs at tp 1" in refused("qwen3.6-27b", Layout(2, executor="native"))
    # accepted: the layouts the lab runs, and ep where experts are split
    for lay in (Layout(1, 2, executor="native"), Layout(1, 1, 2, executor="native"), Layout(2, executor="ray")):
        layout_of(CAT.get("lab-tiny"), CAT, lay, hosts=2)
    layout_of(CAT.get("qwen3-coder-next"), CAT, Layout(1, 1, 2, ep=True, executor="native"), hosts=2)


def test_an_image_whose_vllm_lacks_a_layouts_flags_refuses_it_naming_image_and_version():
    r = CAT.get("qwen3.6-35b-a3b-ngc")  # nvcr.io/nvidia/vllm:26.04-py3, vLLM 0.19.0
    full = load_recorded("vllm-0.19")
    older = FlagSet(name="before-dp", origin="recorded", flags=full.flags - {"--data-parallel-start-rank"})
    check_layout(r, CAT.image(r.image), Layout(1, 1, 2, executor="native"), flagset=full)
    with pytest.raises(InputError) as exc:
        check_layout(r, CAT.image(r.image), Layout(1, 1, 2, executor="native"), flagset=older)
    assert "nvcr.io/nvidia/vllm:26.04-py3 (vLLM 0.19.0; recorded set: before-dp) has no --data-parallel-start-rank" \
        in exc.value.line()


def test_layouts_enumerates_each_executor_the_image_allows():
    tiny = set(layouts(CAT.get("lab-tiny"), CAT, 2))
    assert Layout(1) in tiny and Layout(1, 2, executor="ray") in tiny and Layout(1, 2, executor="native") in tiny
    assert Layout(1, 1, 2, executor="native") in tiny and Layout(1, 1, 2, executor="ray") not in tiny
    # nemotron-3-nano: an NGC image whose vLLM the catalog knows only as < 0.15.1 (native multi-node
    # unknown) and which ships no Ray: Ray in the image cluster-up derives with Ray, and native as
    # cluster-up accepts it, its preflight reading the image (unverified_executor says so)
    nano = set(layouts(CAT.get("nemotron-3-nano"), CAT, 2))
    assert {Layout(1), Layout(1, 2, executor="ray"), Layout(1, 2, executor="native"),
            Layout(1, 1, 2, executor="native")} <= nano
    info = CAT.image(CAT.get("nemotron-3-nano").image)
    assert "cluster-up's preflight" in unverified_executor(info, Layout(1, 2, executor="native"))
    assert unverified_executor(info, Layout(1, 2, executor="ray")) is None  # known: no Ray, cluster-up derives it
    # an image known to predate vLLM's native multi-node launch is refused it, with Ray as the fix
    old = info.model_copy(update={"vllm": "0.11.0"})
    with pytest.raises(InputError) as exc:
        check_layout(CAT.get("nemotron-3-nano"), old, Layout(1, 2, executor="native"))
    assert "predates vLLM's native multi-node launch" in exc.value.line() and "--executor ray" in exc.value.line()


def test_overrides_may_not_set_a_size_against_the_layout(tmp_path):
    assert override_conflicts({"--pipeline-parallel-size": 2}, Layout(1, 2)) is None  # the same: no conflict
    assert "conflicts with the deployment's pp 1" in override_conflicts({"--pipeline-parallel-size": 2}, Layout(1))
    assert "dp 2" in override_conflicts({"--data-parallel-size": 4}, Layout(1, 1, 2))
    assert "ep" in override_conflicts({"--enable-expert-parallel": True}, Layout(2))
    with pytest.raises(ValueError, match="conflicts with the deployment's tp 2"):
        Deployment(name="x", model="lab-tiny", hosts=["a", "b"], tp=2, overrides={"--tensor-parallel-size": 1})
    with pytest.raises(InputError, match="override --pipeline-parallel-size 2 conflicts"):
        render_launch(CAT.get("lab-tiny"), HostServeContext(), 1, {"--pipeline-parallel-size": 2}, catalog=CAT)
    # in a playbook: refused at load, with the file position, before any host
    from sparkprov.data.inventory import load_inventory
    from sparkprov.serving.deployment import load_serve_playbook

    (tmp_path / "inv.yaml").write_text("hosts:\n  spark1: {address: 10.0.0.1}\n  spark2: {address: 10.0.0.2}\n")
    (tmp_path / "pb.yaml").write_text("deployments:\n  - name: d\n    model: lab-tiny\n    hosts: [spark1, spark2]\n"
                                      "    dp: 2\n    overrides: {--data-parallel-size: 4}\n")
    with pytest.raises(InputError) as exc:
        load_serve_playbook(tmp_path / "pb.yaml", load_inventory(tmp_path / "inv.yaml"))
    assert exc.value.line().startswith(f"{tmp_path / 'pb.yaml'}:2:5:") and "dp 2" in exc.value.line()
    (tmp_path / "pb.yaml").write_text("deployments:\n  - {name: d, model: lab-tiny, hosts: spark1, "
                                      "overrides: {--data-parallel-start-rank: 1}}\n")
    with pytest.raises(InputError, match="comes from the deployment"):
        load_serve_playbook(tmp_path / "pb.yaml", load_inventory(tmp_path / "inv.yaml"))


def _ranks(layout: Layout) -> dict[str, spec.ContainerSpec]:
    hosts = list(FABRIC)[:layout.nodes]
    dep = Deployment(name="l", model="lab-tiny", hosts=hosts, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                         ep=layout.ep, executor=layout.executor)
    out = {}
    for h in hosts:
        launch = node.launch(dep, h, {"fabric_ip": FABRIC[h], "fabric_ifaces": "enp1s0f1np1"}, "/home/nvidia", None,
                             None)
        out[h] = node.container(dep, h, launch, FABRIC["spark1"], "0123456789ab" if h != "spark1" else "")
    return out


def serve(s: spec.ContainerSpec) -> list[str]:
    return s.argv[s.argv.index("serve") + 1:]


def env(s: spec.ContainerSpec) -> dict[str, str]:
    return dict(s.argv[i + 1].split("=", 1) for i, w in enumerate(s.argv[:-1]) if w == "-e")


def test_native_data_parallel_ranks():
    r0, r1 = _ranks(Layout(1, 1, 2, executor="native")).values()
    assert r0.role == spec.ROLE_RANK0 and r1.role == spec.ROLE_RANK
    a0, a1 = serve(r0), serve(r1)
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "192.168.100.11",
          "--data-parallel-rpc-port", "29501"]
    assert a0[-len(dp):] == dp and "--host" in a0 and "--headless" not in a0
    assert a1[-len(dp) - 3:] == dp + ["--data-parallel-start-rank", "1", "--headless"]
    assert "--host" not in a1 and "--port" not in a1
    for a in (a0, a1):  # one GPU per replica: no multi-node engine, no executor
        assert "--nnodes" not in a and "--distributed-executor-backend" not in a and a.count("--data-parallel-size") == 1
    # rank 1 watches rank 0's API (vLLM closes the data-parallel handshake port after the start)
    assert env(r1)[supervise.MASTER] == "192.168.100.11:8000" and env(r1)["VLLM_HOST_IP"] == "192.168.100.12"
    assert r0.labels["sparkprov.dp"] == "2" and r0.labels["sparkprov.nodes"] == "2"


def test_pp_layout_ranks_carry_the_stages_once_through_node_launch():
    r0, r1 = _ranks(Layout(1, 2, executor="native")).values()
    for s, rank in ((r0, 0), (r1, 1)):
        a = serve(s)
        assert a.count("--pipeline-parallel-size") == 1 and a[a.index("--pipeline-parallel-size") + 1] == "2"
        assert a[a.index("--node-rank") + 1] == str(rank) and a[a.index("--nnodes") + 1] == "2"
    head = _ranks(Layout(1, 2, executor="ray"))["spark1"]
    a = serve(head)
    assert a.count("--pipeline-parallel-size") == 1 and a[a.index("--distributed-executor-backend") + 1] == "ray"


def test_ep_renders_enable_expert_parallel_for_moe():
    r = CAT.get("qwen3-coder-next")
    launch = render_launch(r, HostServeContext(cluster_size=2), 2, catalog=CAT, ep=True)
    assert launch.has("--enable-expert-parallel") and launch.ep


def test_g35_counts_tp_times_pp_times_dp():
    r = CAT.get("lab-tiny")

    def g35(tp, pp, dp, nodes):
        launch = render_launch(r, HostServeContext(cluster_size=nodes), tp, catalog=CAT, pp=pp, dp=dp)
        return [f for f in lint_launch(launch, catalog=CAT, only=["G35"]) if "node(s)" in f.message]

    assert g35(1, 1, 2, 2) == [] and g35(1, 2, 1, 2) == []
    bad = g35(1, 1, 2, 3)
    assert len(bad) == 1 and bad[0].severity == ERROR and "TP=1 x DP=2 = 2 GPUs" in bad[0].message


def test_lint_flags_vllm_use_v1_on_the_ngc_recipe(tmp_path):
    """qwen3.6-35b-a3b-ngc's notes set VLLM_USE_V1, which no vLLM of its image (0.19) defines."""
    p = tmp_path / "user.yaml"
    p.write_text(user("qwen3.6-35b-a3b-ngc", "env: {VLLM_USE_V1: '1'}\n"))
    cat = load_catalog([p])
    launch = render_launch(cat.get("broken"), HostServeContext(), 1, catalog=cat)
    f = one([x for x in lint_launch(launch, catalog=cat, only=["G4"]) if "VLLM_USE_V1" in x.message], ERROR)
    assert "nvcr.io/nvidia/vllm:26.04-py3 (vLLM 0.19.0; recorded set: vllm-0.19)" in f.message


# ---- one rule for cluster-up, `invoke recipe` and `invoke plan` (issue 35): every layout cluster-up
# accepts over the catalog is one recipe renders and plan allows

FOUR = "".join(f"  spark{i}: {{address: 10.0.0.{i}, vars: {{fabric_ip: 192.168.100.1{i}, fabric_ifaces: enp1s0f1np1}}}}\n"
               for i in range(1, 5))


def cluster_up_layouts(sparks=(2, 3, 4)):
    """(alias, Layout, Sparks) for every tp x pp x dp (+ep, each executor) cluster-up's deployment
    check accepts (serving/deployment.py: Deployment.check, the check a playbook and --model get)."""
    out = []
    for alias in CAT.recipes:
        for n in sparks:
            for tp in range(1, n + 1):
                for pp in range(1, n // tp + 1):
                    if n % (tp * pp):
                        continue
                    for ep in (False, True):
                        for executor in ("ray", "native"):
                            dep = dict(name="x", model=alias, hosts=[f"spark{i}" for i in range(1, n + 1)], tp=tp,
                                       pp=pp, dp=n // (tp * pp), ep=ep, executor=executor)
                            try:
                                d = Deployment(**dep)
                                d.check(CAT)
                            except (InputError, ValueError):
                                continue
                            out.append((alias, d.layout, n))
    return out


def test_recipe_renders_every_layout_cluster_up_accepts(tmp_path, capsys):
    """Before, `invoke recipe` refused 82 of cluster-up's 353 layouts on 2-4 Sparks (30 of 123 on
    two): every layout of an image whose executors the catalog does not record (gpt-oss-120b-tp2's
    among them). Now the one rule of catalog/layout.py decides for both."""
    from invoke import Context

    from sparkprov.cli import catalog as cli

    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults: {user: nvidia}\nhosts:\n" + FOUR)
    accepted = cluster_up_layouts()
    assert len(accepted) > 300 and any(a == "gpt-oss-120b-tp2" for a, _, _ in accepted)
    for alias, lay, n in accepted:
        hosts = ",".join(f"spark{i}" for i in range(1, n + 1))
        cli.recipe(Context(), alias, tp=lay.tp, pp=lay.pp, dp=lay.dp, ep=lay.ep, executor=lay.executor, hosts=hosts,
                   inventory=str(inv), argv=True)
        ranks = json.loads(capsys.readouterr().out)
        assert len(ranks) == n, (alias, lay)


def test_plan_allows_every_shape_cluster_up_accepts(capsys, tmp_path):
    from invoke import Context

    from sparkprov.cli import plan as plan_cli

    accepted = {(a, lay.tp, lay.pp, lay.dp) for a, lay, _ in cluster_up_layouts()}
    for alias in sorted({a for a, *_ in accepted}):
        try:
            plan_cli.plan(Context(), alias, sparks=4, json=True, results=str(tmp_path))
        except Exit as exc:  # exit 2: nothing fits in memory; the rows still say what the rules allow
            assert exc.code == 2
        rows = {(p["tp"], p["pp"], p["dp"]): p for p in json.loads(capsys.readouterr().out)["layouts"]}
        for a, tp, pp, dp in accepted:
            if a == alias:
                assert rows[(tp, pp, dp)]["refused"] is None, (alias, tp, pp, dp, rows[(tp, pp, dp)]["refused"])


@pytest.mark.parametrize("tag, flagged", [("v0.32.0", False), ("v0.33.0", True)])
def test_lint_flags_ray_compiled_graph_variables_on_an_image_on_vllm_0_33(tmp_path, tag, flagged):
    """vLLM 0.33 removed VLLM_USE_RAY_COMPILED_DAG_*: lint reads 0.33's recorded set for an image on
    0.33 and flags them there; on 0.32 they are still variables of its vLLM."""
    p = tmp_path / "user.yaml"
    p.write_text(user("qwen3.6-35b-a3b-ngc", f"image: vllm/vllm-openai:{tag}\n"
                                             "env: {VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE: nccl}\n"))
    cat = load_catalog([p])
    launch = render_launch(cat.get("broken"), HostServeContext(), 1, catalog=cat)
    found = [x for x in lint_launch(launch, catalog=cat, only=["G4"]) if "VLLM_USE_RAY" in x.message]
    if flagged:
        assert f"vllm/vllm-openai:{tag} (vLLM 0.33.0; recorded set: vllm-0.33)" in one(found, ERROR).message
    else:
        assert found == []
