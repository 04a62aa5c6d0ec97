"""All-reduce bandwidth across nodes, as nccl-tests' all_reduce_perf measures it.

Standalone (only torch needed), one process per GPU, started by torchrun:

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HEAD --master-port 29500 \
        --rdzv-conf timeout=120 allreduce_bench.py --min-bytes 1M --max-bytes 2G --iters 20 --warmup 5 \
        --timeout 120 [--json OUT]

(`--rdzv-conf timeout`: how long a rank waits for the others to arrive, torchrun's default 900 s;
`--timeout`: how long one collective waits for the others once they met.)

    torchrun --nproc-per-node 2 allreduce_bench.py          # two GPUs of one machine

The backend is NCCL when CUDA is available (one GPU per local rank), else Gloo on CPU; force one
with --backend. Bind to the fabric with NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME / NCCL_IB_HCA in
the environment (nccl-check sets them from provision's FabricInfo).

For each message size S (bytes, float32 elements) and the mean time t of one all-reduce:
    algbw = S / t                 busbw = algbw * 2 (n - 1) / n      (n = world size)
exactly as nccl-tests reports them (GB/s = 1e9 bytes/s). Every size is checked: each rank
contributes rank+1, so every element must equal n(n+1)/2 afterwards.

Rank 0 prints a table and, last, one JSON line `{"allreduce": {...}}` (and writes it to --json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import sys
import time


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1M, 256K or 2G")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], max(4, lo)
    while s <= hi:
        out.append(s - s % 4)
        s *= factor
    if not out or out[-1] != hi - hi % 4:
        out.append(hi - hi % 4)
    return out


def busbw(algbw: float, n: int) -> float:
    return algbw * 2 * (n - 1) / n if n > 1 else algbw


def if_address(ifname: str | None) -> str | None:
    """The IPv4 address of a network interface (SIOCGIFADDR), or None."""
    if not ifname:
        return None
    import fcntl
    import struct
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
        return socket.inet_ntoa(raw[20:24])
    except OSError:
        return None


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return str(n)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-bytes", type=parse_size, default=parse_size("1M"))
    ap.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"))
    ap.add_argument("--factor", type=int, default=4, help="size multiplier between steps (default 4)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    ap.add_argument("--threshold", type=float, default=None,
                    help="GB/s of bus bandwidth at the largest size below which the run fails (exit 3)")
    ap.add_argument("--json", default=None, help="rank 0 writes the result document here")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds any one collective may wait for the other ranks (a rank gone mid-run)")
    return ap


def _gather_json(obj, *, torch, dist, device, world: int) -> list:
    """all_gather of a JSON document per rank, with tensors only (all_gather_object needs numpy,
    which a serving image's torch may lack)."""
    data = json.dumps(obj).encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lens = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(lens, n)
    width = max(int(x) for x in lens)
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(k)].tolist())) for b, k in zip(bufs, lens)]


def _print_result(result: dict, json_path: str | None) -> None:
    """Rank 0's table, then the result document (also to `json_path`)."""
    rows, where = result["results"], result["ranks"]
    print(f"# all-reduce (sum, float32), backend {result['backend']}, {result['world_size']} ranks: "
          + ", ".join(f"{w['host']}/{w['device']}({w['name']})" for w in where), flush=True)
    print(f"# {'size':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    for r in rows:
        print(f"  {human(r['bytes']):>12} {r['time_us']:12.1f} {r['algbw_gbs']:13.3f} {r['busbw_gbs']:13.3f}")
    doc = json.dumps({"allreduce": result})
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            fh.write(doc + "\n")
    print(doc, flush=True)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)

    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = a.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        # a Spark's container without the GPU (no --gpus, a broken NVIDIA hook): say so, never
        # fall back to Gloo on CPU and report a CPU figure as the fabric's
        print(f"sparkprov: no CUDA device is visible in this container (torch {torch.__version__}); "
              "NCCL needs the GPU", file=sys.stderr, flush=True)
        sys.exit(3)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    host = socket.gethostname()
    ifname = os.environ.get("NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME")
    where = _gather_json({"rank": rank, "host": host, "device": str(device),
                          "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                          "ifname": ifname, "address": if_address(ifname)},
                         torch=torch, dist=dist, device=device, world=world)
    expect = world * (world + 1) / 2
    rows = []
    for size in sizes(a.min_bytes, a.max_bytes, a.factor):
        n = size // 4
        buf = torch.empty(n, dtype=torch.float32, device=device)
        for _ in range(a.warmup):
            buf.fill_(rank + 1)
            dist.all_reduce(buf)
        sync()
        buf.fill_(rank + 1)
        dist.all_reduce(buf)
        sync()
        lo, hi = float(buf.min()), float(buf.max())
        if lo != expect or hi != expect:
            print(f"rank {rank}: all-reduce of {size} bytes gave [{lo}, {hi}], expected {expect}", file=sys.stderr)
            return 2
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(buf)
        sync()
        elapsed = time.perf_counter() - t0
        # the slowest rank defines the collective's time
        t = torch.tensor([elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        per = float(t) / a.iters
        alg = size / per / 1e9
        rows.append({"bytes": size, "time_us": per * 1e6, "algbw_gbs": alg, "busbw_gbs": busbw(alg, world)})
        del buf
    dist.barrier()
    result = {"backend": backend, "world_size": world, "ranks": where, "iters": a.iters, "results": rows,
              "peak_busbw_gbs": max(r["busbw_gbs"] for r in rows),
              "largest": rows[-1], "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None}
    if a.threshold is not None:
        result["threshold_gbs"] = a.threshold
        result["pass"] = rows[-1]["busbw_gbs"] >= a.threshold
    if rank == 0:
        _print_result(result, a.json)
    dist.destroy_process_group()
    if a.threshold is not None and not result["pass"]:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
