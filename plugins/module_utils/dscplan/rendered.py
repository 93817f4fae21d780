"""The files the roles write as rendered here: hostfile, .deepspeed_env, the env's paths, and the
code archive a run ships."""
from __future__ import annotations

import base64
import io
import posixpath
import re
import tarfile

from .settings import ENV_NAME

HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def env_paths(s, install_root):
    manager = s["dsc_env_manager"]
    prefix = {"venv": f"{install_root}/env",
              "conda": f"{install_root}/miniconda/envs/{s['dsc_conda_env_name']}",
              "existing": posixpath.dirname(posixpath.dirname(str(s["dsc_existing_python"] or "")))
              }.get(manager, "")
    python = str(s["dsc_existing_python"]) if manager == "existing" else f"{prefix}/bin/python"
    return prefix, python


def parse_hostfile(text):
    """Parse a hostfile exactly as deepspeed.launcher.runner.fetch_hostfile does; raise on error."""
    hosts = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = HOSTFILE_LINE.match(line)
        if not m:
            raise ValueError(f"Hostfile contains a bad entry: {line}")
        host, slots = m.group(1), int(m.group(2))
        if host in (h for h, _ in hosts):
            raise ValueError(f"Hostfile contains multiple entries for {host}")
        hosts.append((host, slots))
    if not hosts:
        raise ValueError("Hostfile is empty or not formatted correctly")
    return hosts


def parse_ds_env(text):
    """Parse .deepspeed_env as DeepSpeed's runner does (split on the first '='); raise on lines
    it would crash on or mangle."""
    env = {}
    lines = text.split("\n")
    for n, line in enumerate(lines, 1):
        if line == "" and n == len(lines):
            continue  # the final newline
        if "=" not in line:
            raise ValueError(f".deepspeed_env line {n} has no '=' (blank or comment lines crash "
                             f"the launcher): {line!r}")
        key, val = line.split("=", 1)
        if not ENV_NAME.fullmatch(key):
            raise ValueError(f".deepspeed_env line {n}: {key!r} is not a plain variable name")
        env[key] = val
    return env


def render(templates_dir, name, **values):
    """Render templates/<name> (the files users may edit) with Jinja2, as Ansible would."""
    import jinja2  # the control node has it (Ansible needs it); nodes never import this module
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             keep_trailing_newline=True)
    return env.get_template(name).render(**values)


def rendered_files(paths, plan, env, problems):
    """The hostfile and .deepspeed_env from templates/, checked with DeepSpeed's own parsing."""
    hostfile = render(paths["templates"], "hostfile.j2", nodes=plan.nodes)
    env_text = render(paths["templates"], "deepspeed_env.j2", env=env)
    try:
        if len(parse_hostfile(hostfile)) != plan.num_nodes:
            problems.add("templates/hostfile.j2 renders a node count other than the cluster's. "
                         "Fix: one line per node in dsc_plan.nodes.")
        if parse_ds_env(env_text) != {k: str(v) for k, v in env.items() if str(v) != ""}:
            problems.add("templates/deepspeed_env.j2 renders another environment than the plan's. "
                         "Fix: one KEY=VALUE line per variable, nothing else.")
    except ValueError as e:
        problems.add(f"a rendered template breaks DeepSpeed's parser: {e}. Fix: restore "
                     f"templates/hostfile.j2 or templates/deepspeed_env.j2.")
    return hostfile, env_text


def code_archive(code_dir, limit=64 * 2**20):
    """The code directory as base64 of a tar.gz (caches and VCS folders left out), or raise."""

    def keep(info):
        parts = info.name.split("/")
        if any(p in ("__pycache__", ".git", ".ipynb_checkpoints") for p in parts) or info.name.endswith(".pyc"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(code_dir, arcname=".", filter=keep)
    if buf.tell() > limit:
        raise ValueError(f"dsc_code_dir {code_dir} packs to {buf.tell() / 2**20:.0f} MiB, more than "
                         f"{limit / 2**20:.0f} MiB. Fix: keep data and checkpoints out of the code "
                         f"directory, or put it on a shared filesystem (dsc_code_shared: true).")
    return base64.b64encode(buf.getvalue()).decode()
