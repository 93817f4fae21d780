"""Aggregate callback `dsc_preload`: Jinja's filter and test plugins loaded once, in the
playbook's own process, before it forks a worker for each task on each node.

Ansible runs every task on every node in a worker forked from the playbook's process. A worker
that templates a filter (`| to_json`, the project's `dsc_*` filters) or a test loads every filter
or test plugin file first, unless the process it was forked from had loaded them already; and the
playbook's process loads them only when it templates one itself. Loaded here, at the playbook's
start, every worker inherits them: a dry-run launch takes about a fifth less CPU on the control
node (docs/testing.md, "Where the time goes"). It prints nothing and changes no result. Always on
with the project's ansible.cfg (callback_plugins), as it needs no enabling.
"""
from __future__ import annotations

from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, test_loader

DOCUMENTATION = """
    name: dsc_preload
    type: aggregate
    short_description: load Jinja's filter and test plugins once, before the workers fork
    description:
      - Prints nothing; the workers forked for each task inherit the loaded plugins.
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "dsc_preload"
    CALLBACK_NEEDS_ENABLED = False

    def v2_playbook_on_start(self, playbook):
        # One lookup by a short name loads every filter (or test) file on the plugin path.
        filter_loader.get("to_json")
        test_loader.get("match")
