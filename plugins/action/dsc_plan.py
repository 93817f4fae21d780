"""Action `dsc_plan`: validate everything and derive the plan, once, on the control node.

Run by roles/plan (run_once, registered as `dsc_plan` on every host of the play); the logic is in
the package plugins/module_utils/dscplan. It reads each node's inventory values through hostvars, the
nodes' probes (the `probe_var` each node registered), the run options from the play, the names
given with -e, and the defaults from roles/plan/meta/argument_specs.yml and requirements/pins.env;
it fails with every problem at once. With build_helper it only builds the node helper (the file the
probe runs, before the plan) and returns its path and sha256; with probe_arguments, this node's
probe command line (dscplan.probe_arguments).
"""
from __future__ import annotations

import datetime
import json
import os

from ansible.plugins.action import ActionBase
from ansible.utils.vars import load_extra_vars

import dscplan  # plugins/module_utils/dscplan, pure Python

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SPEC = os.path.join(REPO, "roles", "plan", "meta", "argument_specs.yml")
PINS = os.path.join(REPO, "requirements", "pins.env")


def failed(result, messages, header=None):
    """The task's failure: every message, each naming the variable or host and the fix."""
    return dict(result, failed=True, errors=messages,
                msg="\n".join(([header] if header else []) + messages))


def plain(value):
    """Ansible's templated values (tagged str, dict, list) as plain JSON data."""
    return json.loads(json.dumps(value, default=str))


class ActionModule(ActionBase):
    _requires_connection = False
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        if args.get("literal_extra_vars"):
            return self._literal_extra_vars(result)
        if args.get("build_helper"):
            path, sha256 = dscplan.node_helper(REPO)
            return dict(result, changed=False, path=path, sha256=sha256)
        if args.get("probe_arguments"):
            # This node's own settings, the defaults from the argument spec: before any plan.
            values = {k: plain(self._templar.template(task_vars[k]))
                      for k in dscplan.PROBE_SETTINGS if k in task_vars}
            return dict(result, changed=False,
                        argv=dscplan.probe_arguments(values, dscplan.load_defaults(SPEC, PINS)))
        return self._plan(result, args, task_vars)

    def _literal_extra_vars(self, result):
        """The first task of every playbook, before anything reads an -e value: the values as given
        on the command line (and in -e @files), parsed, never templated. Whatever this Ansible's
        own detection calls a template is refused too."""
        problems = dscplan.literal_extra_vars(load_extra_vars(self._loader),
                                               getattr(self._templar, "is_possibly_template", None))
        return failed(result, problems, f"{len(problems)} problem(s), nothing was changed:") \
            if problems else dict(result, changed=False)

    def _plan(self, result, args, task_vars):
        """The plan from every node's inventory values and probe, the run options and the names
        given with -e; every problem at once."""
        hostvars, groups = task_vars["hostvars"], task_vars["groups"]
        names = dscplan.node_order(groups)
        refused = self._play_problems(names, task_vars)
        if refused:
            return failed(result, [refused])
        inventory, variables, probes, unreachable, unprobed = self._nodes(names, hostvars, args["probe_var"])
        options = {k: plain(self._templar.template(task_vars[k]))
                   for k in dscplan.RUN_OPTIONS if k in task_vars}
        # status.yml shows an unreachable node as such, and a resume of a run launched with
        # dsc_min_nodes goes on without it; everything else needs every node.
        allow_unreachable = dscplan.as_bool(self._templar.template(args.get("allow_unreachable", False)))
        without_them = ""  # resume_without's: the plan's first note, or why the run cannot go on
        if unreachable and not allow_unreachable:
            left, without_them = dscplan.resume_without(names, list(unprobed), probes, options)
            if not left:
                return failed(result, unreachable + ([without_them] if without_them else []))
            groups = dict(groups, **{dscplan.CLUSTER_GROUP: left})
        # run: true (launch, resume), "probe" (preflight's all-reduce: an active run is reported
        # by preflight itself), false (status, stop, logs: only which run).
        run_kind = self._templar.template(args.get("run", False))
        run_kind = run_kind if run_kind == "probe" else dscplan.as_bool(run_kind)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        plan, errors = dscplan.make_plan(
            inventory, {k: list(v) for k, v in groups.items()}, probes, dscplan.load_defaults(SPEC, PINS),
            {"repo": REPO, "templates": os.path.join(REPO, "templates")}, options, now=now,
            full_run=run_kind in ("probe", True), refuse_active=run_kind is True,
            firewall=dscplan.as_bool(self._templar.template(args.get("firewall", False))),
            variables=variables, extra_vars=frozenset(map(str, load_extra_vars(self._loader))),
            probe_errors=unprobed)
        if errors:
            return failed(result, errors, f"{len(errors)} problem(s), nothing was changed:")
        if without_them:
            plan["notes"] = [without_them, *plan.get("notes", [])]
        result.update(plan)
        result["changed"] = False
        return result

    @staticmethod
    def _play_problems(names, task_vars):
        """Why the plan cannot be made in this play: --limit left nodes out, or a node failed before it."""
        limited = [h for h in names if h not in task_vars.get("ansible_play_hosts_all", names)]
        if limited:
            return (f"--limit leaves out {', '.join(limited)}: the plan checks and derives the whole "
                    f"cluster (rank order, world size, the hostfile) and needs every node. Fix: run "
                    f"without --limit; to leave a node out, remove it from the group 'cluster'.")
        dropped = [h for h in task_vars.get("ansible_play_hosts_all", [])
                   if h not in task_vars.get("ansible_play_hosts", [])]
        if dropped:
            return (f"host(s) {', '.join(dropped)} failed before the plan (see above). Fix that "
                    f"first: every check of the cluster needs every node.")
        return None

    @staticmethod
    def _nodes(names, hostvars, probe_var):
        """Each node's settings (inventory values), the names of its dsc_ variables, its probe
        (`probe_var`, the plan role's register of it), and why a node could not be probed."""
        inventory, variables, probes, unreachable, unprobed = {}, {}, {}, [], {}
        wanted = dscplan.CLUSTER_SETTINGS + dscplan.NODE_SETTINGS + dscplan.SECRET_SETTINGS + ("ansible_host", "ansible_port")
        for name in names:
            hv = hostvars[name]
            inventory[name] = {var: plain(hv[var]) for var in wanted if var in hv}
            # Names only (iterating hostvars templates nothing): undeclared settings are refused.
            variables[name] = [var for var in hv if str(var).startswith(dscplan.SETTING_PREFIXES)]
            probe = hv.get(probe_var) or {}
            if probe.get("unreachable") or probe.get("failed") or "stdout" not in probe:
                why = " ".join(str(probe.get("msg") or probe.get("stderr") or "no answer").split())
                unprobed[name] = why[:300]
                unreachable.append(f"host {name} could not be probed: {why[:300]}. Fix: check that "
                                   f"Ansible reaches it (ansible -m ping {name}); every check of "
                                   f"the cluster needs every node.")
                continue
            try:
                probes[name] = json.loads(probe["stdout"])
            except ValueError:
                why = " ".join(str(probe.get("stderr") or probe.get("stdout") or "nothing").split())
                unprobed[name] = f"the node probe printed no report ({why[-300:]})"
                unreachable.append(f"host {name}: the node probe printed no report ({why[-300:]}). "
                                   f"Fix: copy .cache/dsc_node.pyz there, run the probe by hand "
                                   f"(python3 dsc_node.pyz probe) and mend what it says.")
        return inventory, variables, probes, unreachable, unprobed
