"""All-reduce bus bandwidth across every rank, started the way a training run is (preflight.yml).

Single node, from the repository root (node/ on the import path: the run directory's names):
    PYTHONPATH=$PWD/node deepspeed --num_gpus 2 --module train.allreduce --sizes 1,16,256
Multi-node, as preflight.yml runs it through launch.yml's path from the master:
    deepspeed --hostfile hostfile --master_addr ADDR --master_port 29500 \
        --module train.allreduce --deepspeed_config ds_config.json --sizes 1,4,16

Bandwidth is reported as nccl-tests defines it for all-reduce: algbw = bytes / time and
busbw = algbw x 2(n-1)/n, with the time of the slowest rank. The backend is DeepSpeed's for the
accelerator (NCCL on GPUs, gloo on CPU). Rank 0 writes $DSC_RUN_DIR/allreduce.json. With
--pairs (doctor.yml) every pair of nodes is measured too, in rounds of disjoint pairs: "pairs".
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch

from dscnode import nccllog
from dscnode.rundir import RunDir


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="all-reduce bus bandwidth (see module docstring)")
    p.add_argument("--sizes", default="1,4,16,64", help="message sizes in MiB, comma separated")
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed all-reduces per size")
    p.add_argument("--out", default="", help="JSON result (default: $DSC_RUN_DIR/allreduce.json)")
    p.add_argument("--pairs", action="store_true",
                   help="then every pair of nodes in rounds (doctor.yml): one rank of each, --pair-size MiB")
    p.add_argument("--pair-size", type=float, default=64.0,
                   help="message size in MiB for --pairs (64: large enough for a link's line rate)")
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

    if args.pairs:  # two ranks a pair: the ring, as nccl-tests measures a link (NCCL reads it at its init)
        os.environ.setdefault("NCCL_ALGO", "Ring")
    acc = get_accelerator()
    run_dir = Path(os.environ.get("DSC_RUN_DIR", "."))
    if acc.device_name() == "cuda":  # which transport NCCL chose, each rank's lines in a file of its own
        (run_dir / RunDir.NCCL).mkdir(exist_ok=True)
        os.environ.update(nccllog.debug_env(run_dir / RunDir.NCCL))
    deepspeed.init_distributed()
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

    pairs = measure_pairs(dist, acc, device, args) if args.pairs else None
    used = nccl_transports(dist, run_dir) if dist.get_backend() == "nccl" else None
    if rank == 0:
        result = {"world_size": world, "backend": dist.get_backend(), "device": str(device.type),
                  "iters": args.iters, "rows": rows,
                  "busbw_gbps_max": max(r["busbw_gbps"] for r in rows),
                  **({"pairs": pairs} if pairs is not None else {}),
                  **({"transport": used} if used is not None else {})}
        out = Path(args.out or run_dir / RunDir.ALLREDUCE)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.rename(out)
    dist.barrier()
    dist.destroy_process_group()


def nccl_transports(dist, run_dir):
    """{node index (CROSS_RANK, hostfile order): what NCCL used there, every rank's own debug file
    read (dscnode.nccllog: a node with more GPUs than NICs has ranks whose channels never leave
    it) and merged}, on global rank 0; None elsewhere."""
    path = run_dir / RunDir.NCCL / f"{socket.gethostname().split('.')[0]}-{os.getpid()}.log"
    mine = (int(os.environ.get("CROSS_RANK", 0)), nccllog.transport(nccllog.read(path) if path.exists() else []))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    nodes = {}
    for node, t in everyone:
        nodes.setdefault(node, []).append(t)
    return {str(node): dict(merged := nccllog.merge(ts), summary=nccllog.summary(merged))
            for node, ts in sorted(nodes.items())}


def measure_pairs(dist, acc, device, args):
    """Every pair of nodes (dscnode.pairs' rounds, the nodes in hostfile order: CROSS_RANK), the
    two nodes' local rank 0 all-reducing --pair-size MiB in their own group while the round's other
    pairs do the same; a world barrier between rounds. Each all-reduce timed alone and the median
    kept: a pair is judged by its link, not by one iteration its node's scheduler delayed. Every
    rank makes every group (new_group is collective). Rank 0's answer: [{nodes: [i, j], time_us, busbw_gbps}]."""
    from dscnode.pairs import pair_rounds  # noqa: PLC0415
    rank = dist.get_rank()
    me = (int(os.environ.get("CROSS_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), rank)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    first = {}  # node index -> the global rank of its local rank 0
    for node, local, r in everyone:
        if local == 0:
            first[node] = r
    rounds = pair_rounds(len(first))
    groups = {p: dist.new_group([first[p[0]], first[p[1]]]) for one in rounds for p in one}
    n = max(1, int(args.pair_size * 2**20) // 4)
    buf = torch.zeros(n, dtype=torch.float32, device=device)
    mine = []
    for one in rounds:
        for pair in one:
            if rank in (first[pair[0]], first[pair[1]]):
                for _ in range(args.warmup):
                    dist.all_reduce(buf, group=groups[pair])
                acc.synchronize()
                each = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    dist.all_reduce(buf, group=groups[pair])
                    acc.synchronize()
                    each.append(time.perf_counter() - t0)
                seconds = statistics.median(each)
                mine.append({"nodes": list(pair), "time_us": round(seconds * 1e6, 1),
                             "busbw_gbps": round(bus_bandwidth(n * 4, seconds, 2)[1], 3)})
        dist.barrier()
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    # Each pair measured by both of its ranks: the slower one's time counts.
    slowest = {}
    for row in (x for rows in found for x in rows):
        key = tuple(row["nodes"])
        if key not in slowest or row["time_us"] > slowest[key]["time_us"]:
            slowest[key] = row
    return [dict(slowest[k], bytes=n * 4) for k in sorted(slowest)]


if __name__ == "__main__":
    main()
