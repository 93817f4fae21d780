"""Provision's one torch import on a node (roles/deepspeed), run by the env's python as the training
user: what torch sees (checked against the GPUs nvidia-smi sees before any op is built for them),
DeepSpeed's ops warmed in the node's JIT cache (TORCH_EXTENSIONS_DIR), the versions provision's
table shows, and whether the kept ds_report was written for these versions.

The ops are built once per kind of node (the plan's node[].ops_kind: same CPU, GPU arch, env and
versions) on that kind's source node (node[].ops_source) and shipped to the others: on a node that
is not its kind's source, an op that ninja would build (missing, or older than its sources) is left
out and named in `awaits`; provision then unpacks the source's build there and warms again with
--build, which loads it (ninja finds nothing to do) or, where the shipped build does not fit the
node after all, builds it."""
import json
import os
import platform
import sys

from dscnode.entry import AfterImport, CpuInfoOnce
from dscnode.procs import run


def op_state(ext_dir, name):
    """"fresh" (built here and ninja has nothing to do), "stale" (built, ninja would rebuild it) or
    "missing": what loading the op would do, read without importing torch."""
    folder = os.path.join(ext_dir, name)
    if not os.path.isfile(os.path.join(folder, f"{name}.so")):
        return "missing"
    rc, out, _ = run(["ninja", "-C", folder, "-n"], timeout=60)
    return "fresh" if rc == 0 and "no work to do" in out else "stale"


def so_mtime(ext_dir, name):
    try:
        return os.stat(os.path.join(ext_dir, name, f"{name}.so")).st_mtime_ns
    except OSError:
        return None


def kept_report_versions(path):
    """The versions the kept ds_report was written for (its first line: "# versions: {...}")."""
    try:
        with open(path) as f:
            return json.loads(f.readline().partition("# versions: ")[2] or "null")
    except (OSError, ValueError):
        return None


def warm(ops, report, gpus_expected, build):
    """{torch_probe, ops, built, awaits, versions, report_current}. `ops`: op builder class names;
    `build`: build what is not fresh here (the kind's source, or after a shipment)."""
    ext_dir = os.environ["TORCH_EXTENSIONS_DIR"]
    # py-cpuinfo's answer, which DeepSpeed asks for twice per op it loads, kept for the ranks as
    # the entry shim keeps it.
    sys.meta_path.insert(0, AfterImport({"cpuinfo": CpuInfoOnce(ext_dir)}))
    import torch
    probe = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
             "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count()}
    gpus_seen = gpus_expected == 0 or (probe["cuda_available"] and probe["gpus"] == gpus_expected)
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    names, built, awaits = [], [], []
    for cls in ops if gpus_seen else []:
        builder = get_accelerator().create_op_builder(cls)
        name = builder.name
        names.append(name)
        if not build and op_state(ext_dir, name) != "fresh":
            awaits.append(name)
            continue
        before = so_mtime(ext_dir, name)
        builder.load(verbose=False)
        if so_mtime(ext_dir, name) != before:
            built.append(name)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda or "cpu", "deepspeed": deepspeed.__version__,
                "nccl": nccl, "gpus": torch.cuda.device_count()}
    return {"torch_probe": probe, "ops": names, "built": built, "awaits": awaits, "versions": versions,
            "report_current": kept_report_versions(report) == versions}

