"""Checks that need no host run before the first connection (issue 24): a bad output path, image
reference, option combination or revision is one line naming the option and the fix, exit 1,
nothing written. The inventory's hosts listen on nothing (port 9): a check made after connecting
would end in "unreachable" (exit 4) instead of this one line."""

import os
from pathlib import Path

import pytest
from invoke import Context

from sparkprov.cli.bench import bench
from sparkprov.cli.catalog import images
from sparkprov.cli.cluster import cluster_up
from sparkprov.cli.gateway import gateway
from sparkprov.cli.monitor import monitor
from sparkprov.cli.store import store
from helpers import SAFE_INVENTORY, refused


@pytest.fixture
def inv(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text(SAFE_INVENTORY)
    return str(path)


def _kinds(tmp_path: Path) -> dict[str, str]:
    fifo, dangling, regular = tmp_path / "fifo", tmp_path / "dangling", tmp_path / "file"
    os.mkfifo(fifo)
    dangling.symlink_to(tmp_path / "gone" / "x")
    regular.write_text("x")
    return {"fifo": str(fifo), "dev-full": "/dev/full", "file": str(regular), "proc": "/proc/self/x",
            "dangling": str(dangling)}


@pytest.mark.parametrize("kind,words", [("fifo", "a FIFO"), ("dev-full", "under /dev"), ("file", "is a file"),
                                        ("proc", "under /proc"), ("dangling", "does not exist")])
def test_bench_results_and_monitor_out_that_are_no_folder(tmp_path, inv, kind, words):
    path = _kinds(tmp_path)[kind]
    msg = refused(lambda: bench(Context(), "dep", results=path, inventory=inv))
    assert msg.startswith(f"--results {path!r}: ") and words in msg
    msg = refused(lambda: monitor(Context(), "write", out=path, inventory=inv))
    assert msg.startswith(f"--out {path!r}: ") and words in msg


@pytest.mark.parametrize("kind", ["fifo", "dev-full", "proc", "dangling"])
def test_images_pin_out_is_checked_before_the_host(tmp_path, inv, kind):
    path = _kinds(tmp_path)[kind]
    msg = refused(lambda: images(Context(), host="s1", inventory=inv, pin=True, out=path))
    assert msg.startswith(f"--out {path!r}: ")


def test_images_pin_without_host_is_the_only_line(tmp_path):
    assert refused(lambda: images(Context(), pin=True, out=str(tmp_path / "p.yaml"))) == (
        "--pin needs --host (fix: give --host HOST (the digests are the ones it pulled))")
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("image", ["litellm main", "x;id", "ghcr.io/berriai/litellm:main\n", "UPPER/case:1",
                                   "ghcr.io/a/b@sha256:short", "$(id)"])
def test_gateway_image_that_is_not_a_reference(inv, image):
    msg = refused(lambda: gateway(Context(), "up", image=image, inventory=inv))
    assert "is not an image reference" in msg or "control characters" in msg


def test_store_verify_with_a_revision_is_refused_not_dropped(inv):
    msg = refused(lambda: store(Context(), verify="org/name@main", inventory=inv))
    assert msg == ("--verify 'org/name@main': a revision ('main') cannot be chosen; --verify hashes the blobs of "
                   "every revision of the repo (fix: give --verify org/name)")


def test_cluster_up_name_without_model(inv):
    assert refused(lambda: cluster_up(Context(), name="mine", inventory=inv)) == (
        "--name needs --model (fix: give --model ALIAS --name NAME, or leave out --name)")
