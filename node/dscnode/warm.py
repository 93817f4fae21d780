"""Provision's one torch import on a node (roles/deepspeed; none where its record answers, below),
run by the env's python as the training user: what torch sees (checked against the GPUs
nvidia-smi sees before any op is built for them), DeepSpeed's ops warmed in the node's JIT cache
(TORCH_EXTENSIONS_DIR), the versions provision's table shows, and whether the kept ds_report was
written for these versions.

The ops are built once per kind of node (the plan's node[].ops_kind: same CPU, GPU arch, env and
versions) on that kind's source node (node[].ops_source) and shipped to the others: on a node that
is not its kind's source, an op that ninja would build (missing, or older than its sources) is left
out and named in `awaits`; provision then unpacks the source's build there and warms again with
--build, which loads it (ninja finds nothing to do) or, where the shipped build does not fit the
node after all, builds it.

A complete answer (nothing awaited) comes with a record of what it depends on, which root keeps
(dscnode.warm_record, read back with --record): the ops asked, the GPUs nvidia-smi sees and the driver, the environment variables the build reads, the
env's installed packages (each top-level entry of site-packages and its mtime: a package
installed, removed or reinstalled changes it) and each op library's mtime. A later warm-up that
finds all of them unchanged answers from the record without importing torch: a provision that
changes nothing spends a few milliseconds here instead of seconds per node."""
import hashlib
import json
import os
import platform
import sys
import sysconfig

from dscnode.entry import AfterImport, CpuInfoOnce
from dscnode.procs import run
from dscnode.rundir import RECORD_LIMIT, read_json


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


RECORD_FORMAT = 1
# What building and loading an op reads from the environment, beside the env's packages.
BUILD_ENV = ("TORCH_EXTENSIONS_DIR", "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME")


def packages_state(folders):
    """A digest of every top-level entry of the given site-packages folders and its mtime (lstat)."""
    state = []
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            try:
                state.append((os.path.join(folder, name), os.lstat(os.path.join(folder, name)).st_mtime_ns))
            except OSError:
                pass
    return hashlib.sha256(json.dumps(sorted(state)).encode()).hexdigest()


def warm_key(ops, gpus_expected, driver, site_packages):
    """What a warm-up's answer depends on, besides the op libraries themselves."""
    return {"format": RECORD_FORMAT, "ops": list(ops), "gpus": gpus_expected, "driver": driver,
            "env": {k: os.environ.get(k) for k in BUILD_ENV}, "packages": packages_state(site_packages)}


def recorded(path, key, ext_dir):
    """The record's answer where its key is `key` and every op library it names has the mtime it
    had then; None otherwise (no record, another key, an op rebuilt, moved or removed)."""
    record = read_json(path, RECORD_LIMIT)
    try:
        out, libs = record["out"], record["libs"]
        fresh = record["key"] == key and set(libs) == set(out["ops"]) and not out["awaits"]
        return out if fresh and all(so_mtime(ext_dir, name) == lib["mtime"] for name, lib in libs.items()) else None
    except (KeyError, TypeError):
        return None


def new_record(key, ext_dir, out):
    """What root keeps of a complete warm-up (roles/deepspeed writes it to dscnode.warm_record(),
    where the training user, who ran the warm-up, cannot change it): its answer, what it depended
    on, and each op library's mtime and sha256 (the probe counts an op as built by the toolkit
    only while its library is that one)."""
    libs = {}
    for name in out["ops"]:
        lib = os.path.join(ext_dir, name, f"{name}.so")
        with open(lib, "rb") as f:
            libs[name] = {"mtime": so_mtime(ext_dir, name), "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    return {"key": key, "libs": libs, "out": out}


def warm(ops, report, gpus_expected, build, record="", driver=""):
    """{torch_probe, ops, built, awaits, versions, report_current, recorded, record}. `ops`: op
    builder class names; `build`: build what is not fresh here (the kind's source, or after a
    shipment); `record`: root's record of the last complete answer (answered from it when nothing
    it depends on changed: `recorded` true, torch not imported). A complete answer found anew
    carries the record for root to keep (`record`; None otherwise)."""
    ext_dir = os.environ["TORCH_EXTENSIONS_DIR"]
    paths = sysconfig.get_paths()
    key = warm_key(ops, gpus_expected, driver, sorted({paths["purelib"], paths["platlib"]}))
    out = recorded(record, key, ext_dir) if record else None
    if out is not None:
        return dict(out, built=[], report_current=kept_report_versions(report) == out["versions"],
                    recorded=True, record=None)
    out = dict(_warm(ops, report, gpus_expected, build, ext_dir), recorded=False)
    complete = not out["awaits"] and len(out["ops"]) == len(ops)  # every op there (torch saw the GPUs)
    return dict(out, record=new_record(key, ext_dir, out) if complete else None)


def _warm(ops, report, gpus_expected, build, ext_dir):
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

