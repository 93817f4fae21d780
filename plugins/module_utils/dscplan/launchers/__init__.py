"""How a run starts, is watched, stops and restarts: one module per launch mode (dsc_launch_mode),
as DeepSpeed's own runner keeps one MultiNodeRunner per backend, chosen once by the plan
(`chosen`). The roles and playbooks run what the chosen one gives (the plan's
`launcher` record and the run's commands) and never name the mode: a unit test
(tests/unit/test_launchers.py) fails on any mention of it outside this package and the settings'
vocabulary.

    pdsh.py    one DeepSpeed launcher on the master, reaching the workers through pdsh (the default)
    no_ssh.py  one launcher per node, started by Ansible, the master first (no ssh between nodes)
    slurm.py   one Slurm batch job on the inventory's nodes, whose task on each node starts that
               node's launcher as no_ssh does
"""
from __future__ import annotations

from .base import Launcher, LauncherRecord, QueueRecord
from .no_ssh import NoSsh
from .pdsh import Pdsh
from .slurm import Slurm

LAUNCHERS: dict[str, type[Launcher]] = {cls.mode: cls for cls in (Pdsh, NoSsh, Slurm)}

__all__ = ["LAUNCHERS", "Launcher", "LauncherRecord", "QueueRecord", "chosen"]


def chosen(settings: dict, where: str, problems) -> Launcher:
    """The launcher of the launch mode the settings choose (dsc_launch_mode): the one place it is
    read. An unknown
    one is a problem (pdsh's launcher stands in, so that every other problem is found too)."""
    mode = str(settings["dsc_launch_mode"])
    if mode not in LAUNCHERS:
        problems.add(f"dsc_launch_mode {where} is {mode!r}. Fix: one of {', '.join(LAUNCHERS)}.")
        mode = Pdsh.mode
    return LAUNCHERS[mode]()
