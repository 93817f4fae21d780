"""Report and status rows for the playbooks' output (the plan itself is
plugins/module_utils/dscplan, derived once by the dsc_plan action).

    {{ (versions, name) | dsc_report_row }}            -> one row of provision's version table
    {{ hostvars | dsc_version_diff(names) }}           -> messages for versions that differ
    {{ status | dsc_status_row }}                      -> one node's row of status.yml
    {{ status | dsc_step_down_lines }}                 -> preset=auto's steps down, a line each
    {{ status | dsc_run_end }}                         -> how a followed run ended, in words
    {{ rows | dsc_runs_table }}                        -> runs.yml's table
    {{ sections | dsc_log_sections(log, read_on) }}    -> logs.yml's last lines under their headers
    {{ reports | dsc_stack_summary }}                  -> where the ranks are, the odd ones first
"""
from __future__ import annotations

import datetime

from dscnode.records import in_attempt
from dscnode.stacks import summary as stack_summary


def _group_by(names, value_of):
    """{str(value): [names having it]}, in inventory order: more than one key means a mismatch."""
    groups = {}
    for name in names:
        groups.setdefault(str(value_of(name)), []).append(name)
    return groups


def report_row(pair):
    versions, name = pair
    v = versions or {}
    return " | ".join([name] + [str(v.get(k, "?")) for k in
                                ("python", "torch", "cuda", "deepspeed", "gpus", "driver", "prefix")])


def version_diff(hostvars, names):
    """Messages for each version that is not the same on every node, naming the nodes."""
    diffs = []
    for key in ("python", "torch", "cuda", "deepspeed", "nccl", "prefix"):
        values = _group_by(names, lambda name: (hostvars[name].get("dsc_versions") or {}).get(key))  # noqa: B023 - called in this iteration
        if len(values) > 1:
            diffs.append(f"{key}: " + ", ".join(f"{v} on {'/'.join(h)}" for v, h in values.items()))
    return diffs


def status_row(st, master_state=None):
    """One node's row of status.yml, its state as the current attempt has it (master_state: the
    master's, which marks a stall for every node)."""
    st = in_attempt(st or {}, master_state)
    if st.get("state") == "unreachable":
        return f"{st.get('host', '?')}: unreachable (node down or sshd stopped)"
    last = st.get("last") or {}
    mem = last.get("mem_allocated_gib", last.get("rss_max_gib"))
    # train.run's metrics give tokens/s and memory; any other script's progress (read from
    # DeepSpeed's engine) gives samples/s and the learning rate.
    rate = (f"tokens/s {last['tokens_per_s']}" if last.get("tokens_per_s") is not None
            else f"samples/s {last['samples_per_s']}" if last.get("samples_per_s") is not None
            else "tokens/s -")
    tail = f"memory {mem} GiB" if mem is not None else f"lr {last['lr']:.3g}" if last.get("lr") is not None else "memory - GiB"
    peak = st.get("memory") or {}
    gib = 2 ** 30
    # the peak per GPU the plan predicted against the one this node's ranks measured (entry shim)
    peak_text = "" if not peak.get("predicted") else (
        f", peak per GPU measured {peak['measured'] / gib:.1f} of predicted {peak['predicted'] / gib:.1f} GiB "
        f"(x{peak['ratio']:.2f}{', OVER' if peak.get('over') else ''})" if peak.get("measured")
        else f", peak per GPU predicted {peak['predicted'] / gib:.1f} GiB")
    # a DeepSpeed op its ranks are JIT-building (the wait before the first step, said as such)
    build = f", {st['op_build']['note']}" if (st.get("op_build") or {}).get("note") else ""
    return (f"{st.get('host', '?')}: {st.get('state', '?')}, ranks alive {st.get('ranks_alive', 0)}, "
            f"step {last.get('step', '-')}, loss {last.get('loss', '-')}, {rate}, {tail}{peak_text}{build}"
            f"{nccl_text(st.get('nccl'))}")


def nccl_text(nccl):
    """What NCCL chose on a node's GPUs (records.nccl_report), its warning with the fix, and the
    last NCCL WARN its ranks wrote; "" where the node kept no NCCL lines (CPU ranks, or a
    dsc_nccl_debug set on purpose)."""
    if not nccl:
        return ""
    judged = f" (WARN: {nccl['fix']})" if nccl.get("status") == "WARN" else ""
    warn = f"; last NCCL WARN: {nccl['warn']}" if nccl.get("warn") else ""
    return f", NCCL {nccl.get('summary')}{judged}{warn}"


def step_down_lines(st):
    """preset=auto's steps down after out-of-memory errors, a line each (status.yml, follow)."""
    return [f"step down {d.get('attempt')}: {d.get('preset')} micro-batch {d.get('micro_batch')} ran out of "
            f"memory{' at step ' + str(d['at_step']) if d.get('at_step') is not None else ''} "
            f"({d.get('cause')}); then {d['next']['preset']} micro-batch {d['next']['micro_batch']}"
            for d in (st or {}).get("step_downs") or []]


def run_end(st):
    """How a followed run ended: finished or stopped on purpose (follow ends with rc 0), at the
    last step it logged; otherwise the state and the first error of its latest attempt, with
    that node's traceback (follow fails with it)."""
    st = st or {}
    run, state = f"Run {st.get('run_id', '?')}", st.get("state", "?")
    step = (st.get("last") or {}).get("step")
    at = f" at step {step}" if step is not None else ""
    if state == "finished":
        return f"{run} finished{at}."
    if state == "stopped":
        by = f" by {st['stopped_by']}" if st.get("stopped_by") else ""
        return f"{run} stopped{by}{at or ' before its first step'}."
    error = st.get("first_error") or (
        f"no error line in its log (exit code {st['exit_code']})" if st.get("exit_code") is not None
        else "its supervisor ended without an exit code (killed, or its node restarted)")
    return "\n".join([f"{run} {state}: {error}"] + list(st.get("traceback") or []))


def runs_table(rows):
    """runs.yml's table: a header and a line per run, newest first. Config: the preset where the
    toolkit's preset is the run's config, else the ZeRO stage the run's engine reported (the node
    helper's config_label). Throughput in the unit the run logs: tokens/s (train.run's metrics),
    else samples/s (any script's progress)."""
    def cell(value, fmt="{}"):
        return "-" if value is None else fmt.format(value)

    def throughput(r):
        if r.get("tokens_per_s") is not None:
            return cell(r["tokens_per_s"], "{:,.0f} tokens/s")
        return cell(r.get("samples_per_s"), "{:,.1f} samples/s")
    lines = ["run | config | state | step | loss | throughput | started (UTC) | duration | restarts"]
    for r in rows or []:
        started = datetime.datetime.fromtimestamp(r["started"], datetime.UTC)
        slow = (r.get("slow") or {}).get("short")  # the rank the others wait for (dscnode.stragglers)
        state = (r["state"] + (f" on {r['nodes']} nodes" if r.get("nodes") else "")  # gone on on fewer (dsc_min_nodes)
                 + (f" (slow: {slow})" if slow else ""))
        lines.append(" | ".join([r["id"], cell(r.get("config")), state, cell(r.get("step")),
                                 cell(r.get("loss"), "{:.4g}"), throughput(r),
                                 started.strftime("%Y-%m-%d %H:%M"),
                                 str(datetime.timedelta(seconds=int(r["duration_s"]))),
                                 str(r.get("restarts", 0))]))
    return lines


def log_sections(sections, log, read_on=None):
    """logs.yml's lines: each section's last lines under a header naming its node and the file
    they were read from, "== node2 (last 5 lines) in node1:/runs/r/launcher.log". `sections`:
    {node: lines}, as the node helper's `log` splits them; `read_on`: the node whose `log` holds
    them all (pdsh mode: the master's, where the section "launcher" is the lines of no node's
    ranks: DeepSpeed's runner, pdsh and the supervisor), else each node's own (no_ssh mode)."""
    out = []
    for name, lines in (sections or {}).items():
        where = read_on or name
        title = f"launcher on {where}" if name == "launcher" else name
        out.append(f"== {title} (last {len(lines)} lines) in {where}:{log}")
        out.extend(lines)
    return out


def slurm_queue(lines, partition):
    """runs.yml in slurm mode: the partition's jobs as squeue lists them ("id|name|state|reason|
    user", in Slurm's own order: running first, then pending by priority and submit time), the
    pending ones numbered by their place in the queue."""
    jobs = [dict(zip(("id", "name", "state", "reason", "user"), line.split("|"), strict=False)) for line in lines if line]
    running = [j for j in jobs if j.get("state") != "PENDING"]
    pending = [j for j in jobs if j.get("state") == "PENDING"]
    out = [f"Slurm queue, partition {partition}: {len(running)} running, {len(pending)} pending"]
    out += [f"  {j['state'].lower()}: job {j['id']} {j['name']} ({j['user']})" for j in running]
    out += [f"  {i}. job {j['id']} {j['name']} ({j['user']}), waiting for {j['reason']}"
            for i, j in enumerate(pending, 1)]
    return out


def slurm_job(lines, user, name):
    """The newest job squeue listed ("id|state|reason|user|name" lines, newest first) that is
    `user`'s and named `name`: {id, state, reason, user, name}, or {}. squeue was asked for that
    user's jobs of that name; a line of another user's or name (a stranger's job of our name) is
    never taken, so that no launch waits on it and no stop cancels it."""
    for line in lines or []:
        job = dict(zip(("id", "state", "reason", "user", "name"), str(line).split("|"), strict=False))
        if job.get("user") == user and job.get("name") == name and str(job.get("id", "")).isdigit():
            return job
    return {}


class FilterModule:
    def filters(self):
        return {
            "dsc_report_row": report_row,
            "dsc_version_diff": version_diff,
            "dsc_status_row": status_row,
            "dsc_step_down_lines": step_down_lines,
            "dsc_run_end": run_end,
            "dsc_log_sections": log_sections,
            "dsc_runs_table": runs_table,
            "dsc_stack_summary": stack_summary,
            "dsc_slurm_queue": slurm_queue,
            "dsc_slurm_job": slurm_job,
        }
