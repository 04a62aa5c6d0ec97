"""The simulated Spark lab: network namespaces as Sparks, their sshd and dockerd, the lab registry
and hub, GB10 stand-ins, the lab images (the real vLLM's and the stand-in engine's), the trained
lab-tiny, faults, `invoke lab.*` (tasks.py) and `make demo` (demo.py).

A package of this repo beside sparkprov, never in sparkprov's wheel: it imports sparkprov, sparkprov
never imports it (.importlinter). It is imported from the checkout: the repo's tasks.py, the
Makefile and the tests run from the repo root, which is on sys.path there; what the lab starts as a
process of its own (the hub) gets the root on PYTHONPATH."""
