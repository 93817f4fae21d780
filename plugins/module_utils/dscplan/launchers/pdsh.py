"""dsc_launch_mode pdsh (the default): one DeepSpeed launcher on the master, which reaches every
worker through pdsh over ssh as the training user; the master's supervisor watches, tears down and
restarts the run on every node, and its log holds every node's output, each line prefixed by its
node."""
from __future__ import annotations

from .base import Launcher, LauncherRecord


class Pdsh(Launcher):
    mode = "pdsh"

    def record(self, nodes, master, slurm):
        names = [n.name for n in nodes]
        return LauncherRecord(name=self.mode, start_nodes=[master], peers=names, log_nodes=[master],
                              ssh_mesh=True, queue=None)

    def commands(self, nodes, master, runner, program):
        return {master: runner + program}

    def supervised_hosts(self, nodes, node):
        return [n.name for n in nodes]

    def shrink_why(self):
        return ""  # the master's supervisor reaches every node: it drops a lost one
