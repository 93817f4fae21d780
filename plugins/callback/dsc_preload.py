"""Aggregate callback `dsc_preload`: Jinja's filter and test plugins loaded once, in the
playbook's own process, before it forks a worker for each task on each node; and the workers
spared the garbage collector's walk over what they inherit.

Ansible runs every task on every node in a worker forked from the playbook's process. A worker
that templates a filter (`| to_json`, the project's `dsc_*` filters) or a test loads every filter
or test plugin file first, unless the process it was forked from had loaded them already; and the
playbook's process loads them only when it templates one itself. Loaded here, at the playbook's
start, every worker inherits them: a dry-run launch takes about a fifth less CPU on the control
node (docs/testing.md, "Where the time goes").

A worker's collections would also walk every object it inherited, copying the pages they sit on
from the playbook's process: the objects are frozen (`gc.freeze`) for each fork and thawed again
in the playbook's process right after it, so that only the workers leave them alone (the pattern
Python's documentation of `gc.freeze` gives). A no-change provision, a dry-run launch and a status
take 2-7 % less CPU on the control node.

It prints nothing and changes no result. Always on with the project's ansible.cfg
(callback_plugins), as it needs no enabling.
"""
from __future__ import annotations

import gc
import os

from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, test_loader

DOCUMENTATION = """
    name: dsc_preload
    type: aggregate
    short_description: load Jinja's filter and test plugins once, before the workers fork
    description:
      - Prints nothing; the workers forked for each task inherit the loaded plugins.
      - Freezes the playbook process's objects for each fork, so that the workers' collections leave them alone.
"""

# Once per process (a module is imported once): frozen for each fork, thawed in this process after it.
os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "dsc_preload"
    CALLBACK_NEEDS_ENABLED = False

    def v2_playbook_on_start(self, playbook):
        # One lookup by a short name loads every filter (or test) file on the plugin path.
        filter_loader.get("to_json")
        test_loader.get("match")
