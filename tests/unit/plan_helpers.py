"""What the plan's tests (tests/unit/test_plan_*.py) share: the settings spec, the pins and the
defaults the plan reads, and a cluster of CPU nodes (hostvars, groups, each node's probe) with the
plan made for it. The tests import it as tests.unit.plan_helpers: the repository root is on the
import path through the control venv's dscluster.pth, as for train and plugins."""
from pathlib import Path

import yaml

import dscplan

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "roles" / "plan" / "meta" / "argument_specs.yml"
OPTIONS = yaml.safe_load(SPEC.read_text())["argument_specs"]["main"]["options"]
PINS = dscplan.read_pins(ROOT / "requirements" / "pins.env")
DEFAULTS = dscplan.load_defaults(SPEC, ROOT / "requirements" / "pins.env")
PATHS = {"repo": str(ROOT), "templates": str(ROOT / "templates")}


def probe(addr, gpus=0, cap="9.0", runs=()):
    return {"gpus": [{"index": str(i), "compute_cap": cap, "driver": "580.1"} for i in range(gpus)],
            "interfaces": {"lo": ["127.0.0.1"], "eth0": [addr]}, "infiniband": False, "rsync": True,
            "runs": list(runs)}


def cluster(n=2, slots=2, gpus=0, runs=(), **settings):
    names = [f"node{i + 1}" for i in range(n)]
    hostvars = {h: dict({"dsc_addr": f"10.0.0.{11 + i}", "dsc_slots": slots}, **settings)
                for i, h in enumerate(names)}
    probes = {h: probe(f"10.0.0.{11 + i}", gpus, runs=runs if i == 0 else ()) for i, h in enumerate(names)}
    if settings.get("dsc_launch_mode") == "slurm":  # the master's sinfo: a partition of every node
        probes[names[0]]["slurm"] = {"partitions": {settings.get("dsc_slurm_partition", "dsc"): names},
                                     "jobs": {}}
    return hostvars, {"cluster": names}, probes


def plan(n=2, options=None, full_run=False, runs=(), **settings):
    hostvars, groups, probes = cluster(n, runs=runs, **settings)
    return dscplan.make_plan(hostvars, groups, probes, DEFAULTS, PATHS, options,
                              now="20261130-000000", full_run=full_run)
