"""All-reduce bus bandwidth across every rank, started the way a training run is (preflight.yml).

Single node, from the repository root (node/ on the import path: the run directory's names):
    PYTHONPATH=$PWD/node deepspeed --num_gpus 2 --module train.allreduce --sizes 1,16,256
Multi-node, as preflight.yml runs it through launch.yml's path from the master:
    deepspeed --hostfile hostfile --master_addr ADDR --master_port 29500 \
        --module train.allreduce --deepspeed_config ds_config.json --sizes 1,4,16

Bandwidth is reported as nccl-tests defines it for all-reduce: algbw = bytes / time and
busbw = algbw x 2(n-1)/n, with the time of the slowest rank. The backend is DeepSpeed's for the
accelerator (NCCL on GPUs, gloo on CPU). Rank 0 writes $DSC_RUN_DIR/allreduce.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from dscnode.rundir import RunDir


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="all-reduce bus bandwidth (see module docstring)")
    p.add_argument("--sizes", default="1,4,16,64", help="message sizes in MiB, comma separated")
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed all-reduces per size")
    p.add_argument("--out", default="", help="JSON result (default: $DSC_RUN_DIR/allreduce.json)")
    p.add_argument("--deepspeed_config", "--deepspeed-config", default="", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes), nccl-tests' all-reduce definitions."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world - 1) / world


def main(argv=None):
    args = parse_args(argv)
    # DeepSpeed after the arguments: --help and a wrong one answer without its start-up.
    import deepspeed  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    deepspeed.init_distributed()
    acc = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if acc.device_name() == "cuda":
        acc.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    # Correctness first: a wrong sum means a broken transport, whatever the speed.
    check = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(check)
    expected = world * (world + 1) / 2
    if not torch.allclose(check, torch.full_like(check, expected)):
        raise SystemExit(f"all-reduce returned {check[0].item()} on rank {rank}, expected {expected}")

    rows = []
    for mib in [float(s) for s in args.sizes.split(",") if s]:
        n = max(1, int(mib * 2**20) // 4)
        buf = torch.zeros(n, dtype=torch.float32, device=device)  # zeros: sums never overflow
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        acc.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buf)
        acc.synchronize()
        elapsed = torch.tensor([(time.perf_counter() - t0) / args.iters], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        seconds = elapsed.item()
        algbw, busbw = bus_bandwidth(n * 4, seconds, world)
        rows.append({"bytes": n * 4, "time_us": round(seconds * 1e6, 1),
                     "algbw_gbps": round(algbw, 3), "busbw_gbps": round(busbw, 3)})
        if rank == 0:
            print(f"all-reduce {n * 4:>12} B  {seconds * 1e6:>10.1f} us  algbw {algbw:8.3f} GB/s  "
                  f"busbw {busbw:8.3f} GB/s", flush=True)

    if rank == 0:
        result = {"world_size": world, "backend": dist.get_backend(), "device": str(device.type),
                  "iters": args.iters, "rows": rows,
                  "busbw_gbps_max": max(r["busbw_gbps"] for r in rows)}
        out = Path(args.out or Path(os.environ.get("DSC_RUN_DIR", ".")) / RunDir.ALLREDUCE)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.rename(out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
