"""stdout callback `dsc_progress`: Ansible's default output, except that while a run is followed
(`-e follow=true`) each poll prints one progress line instead of "FAILED - RETRYING ...", and
while its log is followed (logs.yml -e follow=true) each poll prints the log's new lines.

The node helper's status and log JSON are recognised by their keys; anything else is printed as
the default callback prints it. ansible.cfg selects it (stdout_callback = dsc_progress).
"""
from __future__ import annotations

import datetime
import json
import re
import time

from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = """
    name: dsc_progress
    type: stdout
    short_description: default output, with a followed run's progress instead of retry messages
    description:
      - Ansible's default stdout callback; a retry of the node helper's status (follow=true)
        prints the step (of its total where known), loss, tokens/s (or samples/s), a DeepSpeed op
        being JIT-built, elapsed time, ETA (where the total is known) and the ranks alive on
        every node.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
"""


# What a terminal would obey in a rank's output or a node's record: C0 controls but the tab (ESC
# starts colour, clipboard writes, a cleared screen), DEL, the C1 controls (0x9b is a CSI alone)
# and the Unicode line separators.
TERMINAL_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def shown(text):
    """A line as the operator's terminal may print it: every control character escaped (\\x1b),
    never obeyed; what ranks print is the training user's to choose."""
    return TERMINAL_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                else f"\\u{ord(m.group()):04x}", str(text))


def _duration(seconds):
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def _json_record(stdout, keys):
    """stdout as a JSON object holding `keys`, else None."""
    try:
        record = json.loads(stdout or "")
    except ValueError:
        return None
    return record if isinstance(record, dict) and keys <= set(record) else None


def progress_line(stdout, now=None):
    """One line from the helper's status JSON, or None when stdout is not one. The total and the
    ETA only where the helper knows the run's total (its status says which runs do); the ETA at
    the pace of the last logged steps (a resumed run's earlier attempt and any start-up are not
    in it). A DeepSpeed op the ranks are JIT-building (before their first step, the first time a
    node uses it) is said, with how long so far: the wait is not a hang. Ranks alive: every
    node's (the status's `nodes`, read through pdsh), else this node's, named."""
    st = _json_record(stdout, {"run_id", "state", "last"})
    if st is None:
        return None
    now = time.time() if now is None else now
    last = st.get("last") or {}
    parts = [f"run {st['run_id']}: {st['state']}"]
    step, total = last.get("step"), st.get("total_steps")
    if step is not None:
        parts.append(f"step {step}/{total}" if total else f"step {step}")
    if last.get("loss") is not None:
        parts.append(f"loss {last['loss']:.4g}")
    if last.get("tokens_per_s") is not None:
        parts.append(f"{last['tokens_per_s']:,.0f} tokens/s")
    elif last.get("samples_per_s") is not None:
        parts.append(f"{last['samples_per_s']:,.1f} samples/s")
    build = st.get("op_build") or {}
    if build.get("note"):
        parts.append(build["note"] + (f", {_duration(now - build['since'])} so far" if build.get("since") else ""))
    if st.get("started"):
        parts.append(f"elapsed {_duration(now - st['started'])}")
    pace = last.get("step_time_s")
    if step is not None and total and step < total and pace:
        parts.append(f"ETA {_duration(pace * (total - step))}")
    nodes = st.get("nodes") or {}
    if nodes:
        parts.append(f"ranks alive {sum(n.get('ranks_alive', 0) for n in nodes.values())}")
        parts.append("nodes " + " ".join(f"{name}:{n.get('state')}" for name, n in nodes.items()))
    else:
        parts.append(f"ranks alive {st.get('ranks_alive', 0)} on {st.get('host', 'this node')}")
    if st.get("restarts"):
        parts.append(f"restarts {st['restarts']}")
    if (st.get("slow") or {}).get("short"):  # the rank the others wait for (dscnode.stragglers)
        parts.append(f"slow: {st['slow']['short']}")
    return ", ".join(parts)


def new_log_lines(stdout, printed):
    """(lines of the helper's log tail past byte offset `printed`, the new offset), or None when
    stdout is not a log tail. The first poll shows the tail it was given."""
    tail = _json_record(stdout, {"run_id", "offset", "text"})
    if tail is None:
        return None
    data = tail["text"].encode()
    skip = max(0, (printed or 0) - tail["offset"]) if printed is not None else 0
    return data[skip:].decode(errors="replace").splitlines(), tail["offset"] + len(data)


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "dsc_progress"

    def __init__(self):
        super().__init__()
        self._log_printed = {}  # (host, run id) -> byte offset of the log printed so far

    def _stream_log(self, result):
        key = result.host.get_name()
        got = new_log_lines(result.result.get("stdout"), self._log_printed.get(key))
        if got is None:
            return False
        lines, self._log_printed[key] = got
        for line in lines:
            self._display.display(shown(line))
        return True

    def v2_runner_retry(self, result):
        if self._stream_log(result):
            return
        line = progress_line(result.result.get("stdout"))
        if line is None:
            super().v2_runner_retry(result)
        else:
            self._display.display(shown(line))

    def v2_runner_on_ok(self, result):
        self._stream_log(result)  # the last poll's new lines, then the usual "ok"
        super().v2_runner_on_ok(result)
