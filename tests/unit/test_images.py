"""Images in the catalog: vLLM version, digest or an explicit `unpinned`, executors (G4), the
`invoke images` listing and pinning, and the renders that depend on them."""

import shlex

import pytest

from sparkprov.catalog.images import image_rows, pinned_images_yaml
from sparkprov.catalog.lint import WARNING, lint_launch
from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch
from sparkprov.facts.serving import digest_script, parse_digests
from helpers import one

CAT = load_catalog()
DIGEST = "sha256:" + "0f" * 32


def test_every_catalog_image_states_its_digest_or_unpinned():
    for img in CAT.image_table.values():
        assert img.digest is not None, img.ref
        assert img.digest == "unpinned" or img.is_pinned


def test_image_executors_follow_vllm_version_and_ray():
    ngc = CAT.image("nvcr.io/nvidia/vllm:26.04-py3")
    assert (ngc.vllm_version, ngc.has_ray, ngc.executors) == ("0.19.0", False, ("native",))
    nightly = CAT.image("vllm/vllm-openai:nightly")
    assert nightly.has_ray is False and nightly.executors == ("native",)
    old = CAT.image("vllm/vllm-openai:gemma4")  # 0.18.2: a stock image from before Ray was dropped
    assert old.has_ray is True and old.executors == ("native", "ray")
    assert CAT.image("nvcr.io/nvidia/vllm:25.12.post1-py3").executors == ()  # below 0.15.1: cannot tell
    assert CAT.image("spark-vllm-mxfp4:latest").has_ray is None


def test_images_rows_list_version_digest_executors():
    rows = {r.ref: r for r in image_rows(CAT)}
    assert set(rows) == set(CAT.image_table)
    r = rows["nvcr.io/nvidia/vllm:26.04-py3"]
    assert (r.vllm, r.digest, r.executors, r.ray) == ("0.19.0", "unpinned", "native", "no")
    assert "llama-3.3-70b" in r.used_by


def test_invoke_images_plain_lists_every_image(capsys):
    from invoke import Context

    from sparkprov.cli.catalog import images  # the task function (tasks.py registers it)

    images(Context(), plain=True)
    out = capsys.readouterr().out
    lines = [l.split("\t") for l in out.splitlines()]
    assert {l[0] for l in lines} == set(CAT.image_table)
    assert ["vllm/vllm-openai:nightly", "0.23", "unpinned", "native", "no"] in [l[:5] for l in lines]


def test_digest_script_and_parser_roundtrip():
    script = digest_script(["nvcr.io/nvidia/vllm:26.04-py3"])
    assert "docker image inspect" in script and shlex.split(script.splitlines()[0])  # valid sh words
    out = f"SPARKPROV_DIGEST nvcr.io/nvidia/vllm:26.04-py3 {DIGEST}\nnoise\nSPARKPROV_DIGEST x:1 not-a-digest\n"
    assert parse_digests(out) == {"nvcr.io/nvidia/vllm:26.04-py3": DIGEST}


def test_pin_file_loads_and_pins_the_render(tmp_path):
    p = tmp_path / "pins.yaml"
    p.write_text(pinned_images_yaml(CAT, {"nvcr.io/nvidia/vllm:26.04-py3": DIGEST}, host="spark1"))
    cat = load_catalog([p])
    img = cat.image("nvcr.io/nvidia/vllm:26.04-py3")
    assert img.is_pinned and img.digest == DIGEST and img.digest_source.note == "user"
    assert img.vllm == "0.19.0" and img.entrypoint == "passthrough"
    launch = render_launch(cat.get("llama-3.3-70b"), HostServeContext(), 2, catalog=cat)
    assert launch.image == f"nvcr.io/nvidia/vllm:26.04-py3@{DIGEST}"


def test_G4_unpinned_image_warns_in_a_deployment_and_not_once_pinned(tmp_path):
    host = HostServeContext(host="spark1", host_known=True, model_store="/home/n/vllm",
                            compile_cache="/home/n/cc", api_key_file="/home/n/k")
    r = CAT.get("qwen3.6-35b-a3b-ngc")  # NGC 26.04: a release tag, unpinned

    def g4(cat, ctx):
        launch = render_launch(cat.get(r.alias), ctx, 1, catalog=cat)
        return [f for f in lint_launch(launch, catalog=cat) if f.rule == "G4"]

    f = one(g4(CAT, host), WARNING)
    assert "not pinned to a digest" in f.message and "invoke images --pin" in f.fix
    assert g4(CAT, HostServeContext()) == []  # a release tag outside a deployment: quiet
    p = tmp_path / "pins.yaml"
    p.write_text(pinned_images_yaml(CAT, {"nvcr.io/nvidia/vllm:26.04-py3": DIGEST}, host="spark1"))
    assert g4(load_catalog([p]), host) == []


def test_G4_moving_tag_in_a_deployment_says_so():
    r = CAT.get("qwen3.6-27b")
    ctx = HostServeContext.from_host_vars("spark1", {}, home="/home/nvidia")
    launch = render_launch(r, ctx, 1, catalog=CAT)
    f = one([x for x in lint_launch(launch, catalog=CAT) if x.rule == "G4"], WARNING)
    assert "vllm/vllm-openai:nightly is a moving tag" in f.message


def test_digest_must_be_sha256_or_unpinned(tmp_path):
    from sparkprov.errors import InputError

    p = tmp_path / "bad.yaml"
    p.write_text("images:\n  - {ref: 'x/y:1', digest: latest, entrypoint: custom, source: 'user: mine'}\n")
    with pytest.raises(InputError, match="sha256"):
        load_catalog([p])


def test_native_executor_renders_vllm_multinode_flags_per_rank():
    from sparkprov.catalog.lint import ERROR
    from sparkprov.serving import spec

    base = dict(fabric_ifaces=["enp1s0f1np1"], node_ip="192.168.100.11", cluster_size=2)
    head = render_launch(CAT.get("llama-3.3-70b"), HostServeContext(**base), 2, catalog=CAT)
    ranks = [spec.native_args(head, rank=r, nnodes=2, pp=1, master_addr="192.168.100.10", master_port=29501)
             for r in (0, 1)]
    for rank, argv in enumerate(ranks):
        i = argv.index("--nnodes")
        assert argv[i:i + 8] == ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "192.168.100.10",
                                 "--master-port", "29501"]
        assert "--distributed-executor-backend" not in argv and ("--headless" in argv) == (rank > 0)
    assert "--port" in ranks[0] and "--port" not in ranks[1]  # a headless rank serves no API
    assert [f for f in lint_launch(head, catalog=CAT) if f.severity == ERROR] == []
    assert "native" in CAT.image("nvcr.io/nvidia/vllm:26.04-py3").executors


# -- image references: one parser (sparkprov/imageref.py) ----------------------------------------------

@pytest.mark.parametrize("ref,name,tag,digest,repository", [
    ("vllm/vllm-openai:v0.19.1", "vllm/vllm-openai", "v0.19.1", None, "vllm/vllm-openai"),
    ("nvcr.io/nvidia/vllm:26.04-py3", "nvcr.io/nvidia/vllm", "26.04-py3", None, "nvcr.io/nvidia/vllm"),
    ("docker.io/library/ubuntu:24.04", "docker.io/library/ubuntu", "24.04", None, "ubuntu"),
    ("registry.example:5000/vllm", "registry.example:5000/vllm", None, None, "registry.example:5000/vllm"),
    (f"registry.example:5000/vllm:next@{DIGEST}", "registry.example:5000/vllm", "next", DIGEST,
     "registry.example:5000/vllm"),
    (f"vllm/vllm-openai@{DIGEST}", "vllm/vllm-openai", None, DIGEST, "vllm/vllm-openai"),
])
def test_an_image_reference_parses_into_its_parts_and_back(ref, name, tag, digest, repository):
    from sparkprov.imageref import ImageRef

    got = ImageRef.parse(ref)
    assert (got.name, got.tag, got.digest, got.repository) == (name, tag, digest, repository)
    assert str(got) == ref and got.tagged == ref.split("@")[0]


# -- which image a recipe's containers run: one function (catalog/derive.py choose_image) ------------

def test_the_image_a_recipe_runs_is_chosen_once_with_why():
    from sparkprov.catalog.derive import choose_image, derived_tag, ray_requirement

    plain = CAT.get("qwen3.6-27b")
    recipe = choose_image(plain, CAT)
    assert recipe.requested == recipe.runs == CAT.reference(plain.image) and recipe.why == "recipe"
    other = choose_image(plain, CAT, override="registry.example/vllm:next")
    assert other.requested == other.runs == "registry.example/vllm:next" and other.why == "--image"
    pinned = choose_image(plain, CAT, digest=DIGEST)
    assert pinned.requested == recipe.requested and pinned.why == "pinned"
    assert pinned.runs == f"{recipe.requested.split('@')[0].rsplit(':', 1)[0]}@{DIGEST}"
    # a Ray cluster on an image that ships none runs one derived from it with Ray (a pin cannot apply)
    ray = CAT.get("llama-3.3-70b")
    assert CAT.image(ray.image).has_ray is False and choose_image(ray, CAT).why == "recipe"
    derived = choose_image(ray, CAT, ray_cluster=True, digest=DIGEST)
    assert derived.why == "derived" and derived.ray and derived.requirements == (ray_requirement(),)
    assert derived.runs == derived_tag(derived.requested, [ray_requirement()])
    # a recipe whose pre_serve pip installs: derived with them, whatever the layout
    omni = choose_image(CAT.get("nemotron-3-nano-omni"), CAT)
    assert omni.derived and not omni.ray and omni.requirements == ("vllm[audio]",)
    assert render_launch(CAT.get("nemotron-3-nano-omni"), HostServeContext(), 1, catalog=CAT).image == omni.runs
