"""The product wheel is sparkprov alone: the lab (sparklab/, beside it in this repo) is never in it,
and nothing in it imports the lab. Built as pip builds it for a user, from a copy of the checkout
as a fresh clone has it (no build/ left by an earlier build, whose stale files setuptools would
pack)."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# what a fresh clone lacks: environments, caches and the outputs of earlier builds
NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                        ".lab-cache", ".pytest_cache", ".hypothesis")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    work = tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, work / "src", ignore=NOT_IN_A_CLONE)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "out"),
                        str(work / "src")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    [built] = (work / "out").glob("sparkprov-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def test_the_wheel_holds_sparkprov_and_nothing_else(wheel):
    names = wheel.namelist()
    outside = [n for n in names if n.split("/", 1)[0] != "sparkprov" and not n.startswith("sparkprov-")]
    assert outside == []
    assert [n for n in names if n.startswith("sparkprov/lab/") or "sparklab" in n] == []
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert wheel.read(top_level).decode().split() == ["sparkprov"]


def test_the_wheel_holds_every_file_of_the_package(wheel):
    """Modules and package data (catalog recipes, recorded flag sets) alike."""
    package = REPO / "sparkprov"
    files = {f"sparkprov/{p.relative_to(package).as_posix()}" for p in package.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert files - set(wheel.namelist()) == set()


def test_nothing_in_the_wheel_imports_the_lab(wheel):
    imports_lab = []
    for name in wheel.namelist():
        if not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(wheel.read(name), name)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            imports_lab += [f"{name}:{node.lineno} {m}" for m in modules if m.split(".")[0] == "sparklab"]
    assert imports_lab == []
