"""Build, ahead of need, everything the lab caches: the trained lab-tiny model (with the real vLLM's
image layer, in whose rootfs it trains), the images (the gateway's and Prometheus's too: lab.up only
pushes them then), the hub's generated repos, the Ray venv the engine tests drive and the real
vLLM's unpacked rootfs (whose parser checks every rendered layout).

`make test` starts this in the background and runs the unit tests meanwhile. On a cold machine
these builds take about five minutes of mostly one core; the unit tests, on the other core, hide
them. Every builder below takes its cache's lock, so a test that needs a layer before this is done
waits for it rather than building it a second time, and a build this run cannot make (no network,
a bad wheel) is left to the test that needs it, which fails naming the cause. So each step here is
best effort: its failure is logged and the next step runs.

    python -m sparklab.prebuild
"""
from __future__ import annotations

import subprocess
import sys
import time
import traceback
from pathlib import Path

from . import image

# keyed by what is installed in it, like every other entry of the cache
RAY_VENV = image.CACHE_DIR.parent / f"ray-venv-{image._hash_obj(image.BASE_RECIPE['pip'])[:12]}"


def ensure_ray_venv(venv: Path = RAY_VENV) -> str:
    """A venv on this machine with the lab image's pip set (Ray, huggingface_hub): the python the
    engine tests start Ray clusters with. Made once; returns its python."""
    py = venv / "bin" / "python"

    def has_ray() -> bool:
        return py.exists() and subprocess.run([str(py), "-c", "import ray"], capture_output=True).returncode == 0

    if not has_ray():
        venv.parent.mkdir(parents=True, exist_ok=True)
        with image._cache_lock(venv.parent):
            if not has_ray():
                subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
                r = subprocess.run([str(py), "-m", "pip", "install", "-q", *image.BASE_RECIPE["pip"]],
                                   capture_output=True, text=True, timeout=1200)
                if r.returncode != 0:
                    raise RuntimeError(f"pip install {' '.join(image.BASE_RECIPE['pip'])}: "
                                       f"{(r.stdout + r.stderr)[-2000:]}")
    return str(py)


def _hub_repos() -> None:
    from .hub.manage import default_root, lab_repos
    from .hub.repos import ensure_generated

    for spec in lab_repos():
        ensure_generated(spec, default_root())


def _tiny_model() -> None:
    from .tinymodel import ensure_tiny_model

    ensure_tiny_model()


def _readme_images() -> None:
    """The gateway's and Prometheus's (image.readme_images): lab.up pushes them, the lab tests run them."""
    image.build_images(image.readme_images())


STEPS = (("lab-tiny", _tiny_model), ("images", image.build_images), ("hub repos", _hub_repos),
         ("ray venv", ensure_ray_venv), ("real vLLM rootfs", image.ensure_vllm_rootfs),
         ("gateway and prometheus images", _readme_images))


def main() -> int:
    failed = 0
    for name, step in STEPS:
        t0 = time.monotonic()
        try:
            step()
            print(f"prebuild: {name} ready in {time.monotonic() - t0:.0f}s", flush=True)
        except Exception:  # noqa: BLE001 - best effort: the test that needs it reports the cause
            failed += 1
            print(f"prebuild: {name} FAILED after {time.monotonic() - t0:.0f}s (the tests that need it "
                  f"will build it or fail naming why):\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
