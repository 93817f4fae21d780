#!/usr/bin/env bash
# What the GPU health gate and NCCL's transport reader are tested on (docs/preflight.md): this
# machine's `nvidia-smi -q -x` and `-q`, its kernel log's Xid lines, its interfaces' stated speeds,
# and a one-rank NCCL run's INFO lines (NCCL_DEBUG_SUBSYS=INIT,NET,ENV,GRAPH) with RAS's answer to
# STATUS, text and JSON, asked on its client port while the communicator lives.
#
#   bench/gpu_capture.sh        -> $OUT/capture-<gpu>.tar.gz (default OUT ./gpu-results)
# tests/fixtures/gpu/h100-capture.xml is this script's nvidia-smi-q-x.xml from an H100 (each fault in
# tests/unit/test_gpu_health.py is one edit of it); tests/fixtures/nccl/README.md lists what it took of NCCL.
set -uo pipefail
out=${OUT:-$PWD/gpu-results}; mkdir -p "$out"; d=$(mktemp -d)
. "$(dirname "$0")/gpu_ansible.sh"  # py, repo_path (no Ansible here)
nvidia-smi -q -x > "$d/nvidia-smi-q-x.xml"; nvidia-smi -q > "$d/nvidia-smi-q.txt"
{ nvidia-smi --version; uname -r; cat /etc/os-release | head -2
  for i in /sys/class/net/*; do echo "$i speed=$(cat "$i/speed" 2>&1) operstate=$(cat "$i/operstate")"; done
  ls /sys/class/infiniband 2>&1; command -v dcgmi nv-hostengine iperf3 2>&1
} > "$d/machine.txt" 2>&1
{ dmesg 2>&1 || journalctl -k --no-pager 2>&1; } | grep -iE 'xid|nvrm|dmesg|journal' | head -200 > "$d/kernel-xid.txt"
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,ENV,GRAPH MASTER_ADDR=127.0.0.1 MASTER_PORT=29630 \
  PYTHONPATH=$repo_path \
  timeout 120 $py - "$d" > "$d/nccl-run.txt" 2> "$d/nccl-info.log" <<'PY'
import socket, sys, time, torch, torch.distributed as dist

def ras(fmt):
    """RAS's client protocol (NCCL's src/ras/client.cc): handshake, optional format, STATUS."""
    with socket.create_connection(("127.0.0.1", 28028), timeout=15) as s:
        f = s.makefile("rwb")
        def say(line):
            f.write(line.encode() + b"\n"); f.flush()
            return f.readline().decode()
        reply = [say("CLIENT PROTOCOL 2")]
        if fmt != "text":
            reply.append(say(f"SET FORMAT {fmt}"))
        f.write(b"VERBOSE STATUS\n"); f.flush()
        return "".join(reply) + f.read().decode()

dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
print("nccl", torch.cuda.nccl.version(), "torch", torch.__version__, flush=True)
x = torch.ones(16 << 20, device="cuda")  # 64 MiB of fp32
for _ in range(20):
    dist.all_reduce(x)
torch.cuda.synchronize()
time.sleep(2)
for fmt, name in (("text", "ras-status.txt"), ("json", "ras-status.json")):
    try:
        open(f"{sys.argv[1]}/{name}", "w").write(ras(fmt))
    except OSError as e:
        print(f"RAS {fmt}: {e}", flush=True)
try:  # the supervisor's own reader (node/dscnode/ncclras.py), as a stall asks it
    from dscnode import ncclras
    t0 = time.time()
    answer = ncclras.ask()
    print("ncclras.ask", round(time.time() - t0, 2), "s;", ncclras.said(ncclras.behind(answer)) or "all agree", flush=True)
except (ImportError, OSError, ValueError) as e:
    print(f"ncclras: {e}", flush=True)
dist.destroy_process_group()
PY
echo "nccl run rc=$?" >> "$d/nccl-run.txt"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9\n' - | tr -s - | cut -c1-40)
tar czf "$out/capture-${gpu%-}.tar.gz" -C "$d" . && ls -la "$d"
