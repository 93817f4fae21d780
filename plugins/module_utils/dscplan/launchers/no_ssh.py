"""dsc_launch_mode no_ssh: one DeepSpeed launcher per node (--no_ssh --node_rank), each started by
Ansible on its node, the master first and the others on the master port it took; no ssh between
nodes. Each node's supervisor watches its own ranks and keeps its own log; no restarts (a
restart must restart every node's ranks together, which no supervisor here can)."""
from __future__ import annotations

from ..problems import is_int
from .base import Launcher, LauncherRecord


class PerNode(Launcher):
    """A launch mode that starts one DeepSpeed launcher on every node (--no_ssh --node_rank): no
    supervisor reaches another node's ranks."""

    def commands(self, nodes, master, runner, program):
        return {n.name: runner + ["--no_ssh", "--node_rank", str(n.rank)] + program for n in nodes}

    def step_down_why(self, num_nodes):
        return f"dsc_launch_mode {self.mode} (each node's launcher runs on its own)" if num_nodes > 1 else ""


class NoSsh(PerNode):
    mode = "no_ssh"
    agrees_latest = "ansible"

    def record(self, nodes, master, slurm):
        names = [n.name for n in nodes]
        return LauncherRecord(name=self.mode, start_nodes=names, peers=[], log_nodes=names,
                              ssh_mesh=False, queue=None)

    def option_problems(self, opt, problems):
        if is_int(opt["max_restarts"]) and int(opt["max_restarts"]) > 0:
            problems.add(f"max_restarts is {opt['max_restarts']} with dsc_launch_mode no_ssh. Fix: 0 "
                         f"(each node's launcher runs on its own there, and a restart must restart every "
                         f"node's ranks together: the pdsh mode's supervisor does, and slurm mode's batch "
                         f"job), or dsc_launch_mode pdsh.")
