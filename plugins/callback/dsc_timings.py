"""Aggregate callback `dsc_timings`: where a playbook's time goes, one JSON line per playbook run.

Enabled with ANSIBLE_CALLBACKS_ENABLED=dsc_timings and DSC_TIMINGS=<file> (the test suite sets
both; scripts/test.sh summarises the file): the playbook, its wall time, and each task's wall
time from its start to the next task's (the whole fan-out over the nodes, as a person waits for it).
"""
from __future__ import annotations

import json
import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: dsc_timings
    type: aggregate
    short_description: per-task wall time of a playbook, appended as one JSON line to $DSC_TIMINGS
    description:
      - Writes nothing unless DSC_TIMINGS names a file.
    requirements:
      - enabled through callbacks_enabled (ANSIBLE_CALLBACKS_ENABLED=dsc_timings)
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "dsc_timings"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._path = os.environ.get("DSC_TIMINGS")
        self._playbook = None
        self._start = time.time()
        self._task = None
        self._tasks = {}

    def _close_task(self):
        if self._task:
            name, t0 = self._task
            self._tasks[name] = round(self._tasks.get(name, 0.0) + time.time() - t0, 2)
        self._task = None

    def v2_playbook_on_start(self, playbook):
        self._playbook = os.path.basename(playbook._file_name)
        self._start = time.time()

    def v2_playbook_on_task_start(self, task, is_conditional=False):  # handlers: (task) only
        self._close_task()
        self._task = (task.get_name(), time.time())

    v2_playbook_on_handler_task_start = v2_playbook_on_task_start

    def v2_playbook_on_stats(self, stats):
        self._close_task()
        if not self._path:
            return
        line = {"playbook": self._playbook, "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
                "seconds": round(time.time() - self._start, 2), "tasks": self._tasks}
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
