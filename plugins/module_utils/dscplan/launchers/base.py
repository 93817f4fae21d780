"""What every launch mode gives the plan (Launcher) and what the roles read of it (LauncherRecord,
the plan's `launcher`): where the node helper starts the run, where its state and output are
read, whether a batch queue holds it. A mode's module says how; nothing else asks which mode."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

from typing import TYPE_CHECKING

from ..problems import as_bool

if TYPE_CHECKING:  # the plan's records, which hold a LauncherRecord themselves
    from ..record import NodeRecord, Plan, SlurmRecord


@dataclass
class QueueRecord:
    """The batch queue a run is submitted to (roles/runs' queue_*.yml): the job is named
    `job_prefix` + the run id and is the training user's own; status shows it, stop cancels it."""
    partition: str
    job_prefix: str  # the job's name is job_prefix + run id (squeue --name), the training user's jobs only


@dataclass
class LauncherRecord:
    """What the roles and playbooks read of the launch mode (`dsc_plan.launcher`): capabilities,
    never the mode's name to branch on."""
    name: str  # dsc_launch_mode, for messages only
    start_nodes: list[str]  # where the node helper's start runs: the first takes the master port, the others the port it took
    peers: list[str]  # the nodes the master reaches (pdsh) for every node's state and log lines; [] where each node keeps its own
    log_nodes: list[str]  # the nodes whose own launcher log holds the run's output
    ssh_mesh: bool  # runs need ssh from the master to every node as the training user (preflight's mesh row)
    queue: QueueRecord | None  # the batch queue that holds the run, where one does


class Launcher(ABC):
    """One launch mode: how the plan starts, watches, stops and restarts a run through it."""
    mode: str  # its dsc_launch_mode
    # A second launch while a run is active: refused (a run holds the nodes), or queued behind it.
    queues = False

    def probe_options(self) -> list[str]:
        """What every node's probe also reads for this mode (dscnode.probe's options)."""
        return []

    @abstractmethod
    def record(self, nodes: list[NodeRecord], master: str, slurm: SlurmRecord) -> LauncherRecord:
        """What the roles read (the plan's `launcher`)."""

    @abstractmethod
    def commands(self, nodes: list[NodeRecord], master: str, runner: list[str], program: list[str]) -> dict[str, list[str]]:
        """{node: the DeepSpeed launcher's argv} on every node that starts one: `runner` DeepSpeed's
        runner and its options, `program` what each rank runs."""

    def restarts(self, max_restarts: int) -> int:
        """The supervisor's own restarts (--max-restarts): max_restarts, where the supervisor restarts."""
        return max_restarts

    def supervised_hosts(self, nodes: list[NodeRecord], node: str) -> list[str]:
        """The nodes a node's supervisor tears down and restarts: its own alone, unless it reaches
        the others."""
        return [node]

    def start_args(self, nodes: list[NodeRecord], commands: dict, opt: dict, run_root: str, py_spy: str,
                   resume_args: list[str]) -> dict[str, list[str]]:
        """{node: the node helper's `start` options}, but the port."""
        return {node: ["--run-root", run_root, "--hosts", ",".join(self.supervised_hosts(nodes, node)),
                       "--max-restarts", str(self.restarts(int(opt["max_restarts"]))),
                       "--backoff", str(int(opt["restart_backoff_s"])),
                       "--resume-args", json.dumps(resume_args),
                       "--stall-s", str(int(opt["dsc_stall_timeout_s"])), "--py-spy", py_spy,
                       "--used-gpus", json.dumps({n.name: n.used_gpus for n in nodes})]
                + (["--stall-fail"] if as_bool(opt["dsc_stall_fail"]) else [])
                + ([] if as_bool(opt["dsc_checkpoint_copies"]) else ["--no-copies"])
                + (["--replace"] if as_bool(opt["replace"]) else [])
                for node in commands}

    def option_problems(self, opt: dict, problems) -> None:
        """The run options this mode cannot honour."""
        return  # none, unless the mode says

    def cluster_problems(self, nodes: list[NodeRecord], where: str, problems) -> None:
        """What in the cluster this mode cannot launch on, before any node changes."""
        return  # none, unless the mode says

    def run_problems(self, master: str, nodes: list[NodeRecord], slurm: SlurmRecord, run_id: str, probe: dict,
                     problems) -> None:
        """Before a run is started (launch, resume): what the master's probe says would stop it."""
        return  # none, unless the mode says

    def shrink_why(self) -> str:
        """Why a run cannot go on on fewer nodes (dsc_min_nodes) in this mode ("": it can)."""
        return (f"dsc_launch_mode {self.mode} starts no supervisor that reaches every node to drop a lost "
                f"one. Fix: dsc_launch_mode pdsh")

    def step_down_why(self, num_nodes: int) -> str:
        """Why preset=auto cannot step down after an out-of-memory error in this mode ("": it can)."""
        return ""

    def files(self, plan: Plan, run_id: str, run_dir: str, workdir: str, commands: dict, start_args: dict,
              env: dict, restarts: tuple[int, int], globs: list[str]) -> dict[str, str]:
        """The run directory's files this mode adds (name -> text), written at launch and again at
        every resume (`restarts`: max_restarts and the backoff; `globs`: the run's `{latest:GLOB}`s,
        in its command or its resume arguments)."""
        return {}

    # Where the nodes agree on each `{latest:GLOB}` before a start, where no supervisor reaches
    # the others to take the newest match complete on all (pdsh's does, before every attempt):
    # "ansible" (the runs role asks every node before it starts them), "batch job" (the job asks
    # every node before each attempt).
    agrees_latest = ""
