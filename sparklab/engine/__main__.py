import sys

if sys.argv[1:3] == ["bench", "serve"]:  # vLLM's benchmark client (the lab's stand-in for it)
    from .bench import main as bench_main

    sys.exit(bench_main(sys.argv[3:]))

from .cli import main  # noqa: E402
from .engine import run  # noqa: E402

sys.exit(main(run=run))
