"""What is refused in any setting or run option, whatever its own check: control characters (a
newline splits a command line on the nodes) and Jinja templates in -e values (a lookup would run
on the control node)."""
from __future__ import annotations

import re

from .vocabulary import CLUSTER_SETTINGS, JSON_ONLY, NODE_SETTINGS, RUN_OPTIONS


# Control characters (C0, DEL, C1, the Unicode line separators): refused in every setting and run
# option, whatever its own check (see control_characters).
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def control_paths(value, where):
    """The paths of the strings in value (keys included) that hold a control character."""
    if isinstance(value, str):
        return [(where, CONTROL.search(value).group())] if CONTROL.search(value) else []
    if isinstance(value, dict):
        return [(f"{where} (a key)", CONTROL.search(k).group()) for k in value
                if isinstance(k, str) and CONTROL.search(k)] + \
               [p for k, v in value.items() for p in control_paths(v, f"{where}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in control_paths(v, f"{where}[{i}]")]
    return []


def control_characters(hostvars, names, options, problems):
    """Every setting and run option, whole (list items and mapping keys too): a control character
    (a trailing newline, a carriage return, a NUL) is refused, whatever the setting's own check.
    DeepSpeed's runner quotes only arguments with a space, so a newline there starts a second
    command on every node; a free-form command splits on it. Cluster-wide settings are read on
    the first node (another value elsewhere is reported as differing); dsc_secrets by name."""
    fix = ("Fix: the value without it (YAML's | and > blocks and a copied line end add a "
           "trailing newline): control characters split commands and arguments on the nodes.")
    for i, node in enumerate(names):
        hv = hostvars.get(node) or {}
        wanted = NODE_SETTINGS + (CLUSTER_SETTINGS if i == 0 else ())
        found = [p for var in wanted if var in hv for p in control_paths(hv[var], var)]
        secrets = hv.get("dsc_secrets") if i == 0 else None
        if isinstance(secrets, dict):
            found += [("dsc_secrets (a name)", CONTROL.search(k).group()) for k in secrets
                      if isinstance(k, str) and CONTROL.search(k)]
        for path, char in found:
            problems.add(f"{path} on host {node} holds a control character ({char!r}). {fix}")
    for var in RUN_OPTIONS:
        if var in (options or {}) and var not in JSON_ONLY:
            for path, char in control_paths(options[var], var):
                problems.add(f"{path} holds a control character ({char!r}). {fix}")


# What makes a string a template to Ansible: a start string of Jinja's default delimiters, or a
# '#jinja2:' header (ansible-core 2.19 templates a string that begins with one, with whatever
# delimiters the header sets). Refused anywhere in the string: a superset of both.
JINJA = re.compile(r"{{|{%|{#|#jinja2:")


def templates_in(value, where, is_template=None):
    """The paths of the strings in value (an -e value: str, list, dict; keys too) that Ansible
    would evaluate as templates (lookups run commands on the control node), so the plan refuses
    them: JINJA, and `is_template` (the running Ansible's own detection, when given) besides."""
    def hit(text):
        return isinstance(text, str) and bool(JINJA.search(text) or (is_template and is_template(text)))
    if isinstance(value, str):
        return [where] if hit(value) else []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in templates_in(v, f"{where}.{k}", is_template)] + \
               [f"{where} (a key)" for k in value if hit(k)]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in templates_in(v, f"{where}[{i}]", is_template)]
    return []


def literal_extra_vars(extra, is_template=None):
    """Every -e value is taken literally: a problem per variable that holds a Jinja template."""
    return [f"{path} holds a Jinja template ('{{{{', '{{%', '{{#' or a '#jinja2:' header): -e values "
            f"are taken literally and never evaluated (a lookup there would run on the control "
            f"node). Fix: pass the plain value."
            for name, value in extra.items()
            for path in (templates_in(value, str(name), is_template)
                         + ([f"{name} (the name)"] if templates_in(str(name), "", is_template) else []))]
