"""python -m sparklab.hub --bind 10.77.0.1 --port 8080 --spec repos.yaml [--token-file F] [--throttle 50M]"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path

from .manage import DEFAULT_REPOS, default_root
from .repos import coerce_spec, ensure_generated, load_spec_file
from .server import HubServer, HubState, check_bind_address, read_token_file

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_rate(text: str) -> int:
    """Bytes/s: 1000000, 1M / 1MB (10^6), 1Mi / 1MiB (2^20), 500k ..."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]i?)?[bB]?(?:/s)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad rate {text!r} (e.g. 1000000, 50M, 20MiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparklab.hub", description=__doc__)
    p.add_argument("--bind", default="127.0.0.1", help="loopback or lab bridge address (10.77.0.0/24)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--root", type=Path, default=None, help="cache of generated repos (default: hub/ of the lab's cache)")
    p.add_argument("--spec", type=Path, help="JSON/YAML list of repo specs (or {repos: [...]})")
    p.add_argument("--repo", action="append", default=[], help="serve this repo id with default settings")
    p.add_argument("--token-file", type=Path, help="file (mode 600) holding the lab token for gated repos")
    p.add_argument("--throttle", type=parse_rate, default=None, help="global bytes/s limit (e.g. 50M)")
    p.add_argument("--generate-only", action="store_true", help="generate the repos into --root and exit")
    args = p.parse_args(argv)

    check_bind_address(args.bind)
    specs = load_spec_file(args.spec) if args.spec else []
    specs += [coerce_spec(r) for r in args.repo]
    if not args.spec and not args.repo:
        specs = list(DEFAULT_REPOS)
    if not specs:
        p.error("no repos to serve")
    root = args.root or default_root()
    repos = [ensure_generated(s, root) for s in specs]
    for r in repos:
        print(f"repo {r.repo_id} commit {r.commit} files {len(r.files)} "
              f"bytes {sum(f.size for f in r.files.values())}{' gated' if r.spec.gated else ''}", flush=True)
    if args.generate_only:
        return 0
    token = read_token_file(args.token_file) if args.token_file else None
    server = HubServer(args.bind, args.port, HubState(repos, token=token, throttle_bps=args.throttle), sys.stderr)

    def _term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    print(f"serving {len(repos)} repos on {server.url}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
