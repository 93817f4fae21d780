"""Write docs/configuration.md from the roles' meta/argument_specs.yml: every option of every
entry point, with its type, default, choices and description.

    python3 scripts/config_doc.py > docs/configuration.md     # regenerate the page
    python3 scripts/config_doc.py --check                     # exit 1 when the page differs

The plan's options are grouped by the comments in its spec ("# Cluster-wide.", "# Per node.",
"# Run options (-e)."); the other roles follow in name order.
"""
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
PINS = ROOT / "requirements" / "pins.env"

INTRO = """\
# Configuration

Generated from the roles' `meta/argument_specs.yml` by
`python3 scripts/config_doc.py > docs/configuration.md`: edit the specs, then regenerate
(`tests/unit/test_config_doc.py` fails while the two differ).

Where a setting goes: per-node settings beside each host in `inventory/<cluster>/hosts.yml`,
cluster-wide ones in `inventory/<cluster>/group_vars/all.yml`, run options with `-e` on the
command line (`-e preset=zero3`, or JSON for lists and dicts:
`-e '{"dsc_entry_args": ["--set", "size=125m"]}'`). Every setting the plan reads is declared in
`roles/plan/meta/argument_specs.yml`, the one source of defaults
(`ansible-doc -t role -r roles plan` prints it); of `dsc_secrets`, tokens for the ranks, the plan
reads the names alone ([Your own scripts](own-scripts.md#bring-your-own-script)). A `dsc_` or
`cluster_network_` variable that no role declares is refused, naming the current name of one an
earlier version read. The plan checks them all at once, before any node changes. Cluster-wide settings must be the same
on every node (one message names the nodes when they differ). Run options are read by the plan
for launch.yml and resume.yml; status, stop and logs read `run_id`. Each role's own options
follow the plan's.

torch and DeepSpeed default to the pins in `requirements/pins.env`: {pins}.
"""


def markup(text: str | list) -> str:
    """Ansible's C(), V(), O(), I(), B() markup as code spans, '<' and '>' outside them escaped
    (Markdown would take <run dir> for an HTML tag); one line, for a table cell."""
    if isinstance(text, list):
        text = " ".join(text)
    parts = re.sub(r"\b[CVOIB]\(([^)]*)\)", r"`\1`", str(text)).split("`")
    parts[::2] = [p.replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return " ".join("`".join(parts).split())


def paragraphs(text: str | list) -> list[str]:
    """A role's description as Markdown paragraphs."""
    if isinstance(text, list):
        return [markup(t) for t in text]
    return [markup(p) for p in str(text).split("\n") if p.strip()]  # folded: a newline ends one


def value(v: object) -> str:
    """A default or a choice as a code span: strings as they are, anything else as JSON."""
    if isinstance(v, str):
        return "`" + v + "`" if v else '`""`'
    return "`" + json.dumps(v) + "`"


def cell(text: str) -> str:
    """Text safe inside a table cell."""
    return text.replace("|", "\\|")


def rows(options: dict, prefix: str = ""):
    """Table rows for options, nested ones (a dict's own options) as parent.child."""
    for name, spec in options.items():
        kind = spec.get("type", "str")
        if spec.get("elements"):
            kind += " of " + spec["elements"]
        if spec.get("required"):
            kind += ", required"
        default = value(spec["default"]) if "default" in spec else ""
        choices = ", ".join(value(c) for c in spec.get("choices", []))
        yield (f"| `{prefix}{name}` | {kind} | {cell(default)} | {cell(choices)} | "
               f"{cell(markup(spec.get('description', '')))} |")
        yield from rows(spec.get("options") or {}, prefix + name + ".")


def groups(spec_file: Path, options: dict) -> list[tuple[str | None, dict]]:
    """[(heading or None, {name: spec})]: the options split at the spec's own comment lines
    (indented as the option names are)."""
    out = [(None, {})]
    for line in spec_file.read_text().splitlines():
        comment = re.match(r"^ {6}# (.+?)\.?$", line)
        key = re.match(r"^ {6}(\w+):", line)
        if comment:
            out.append((comment.group(1), {}))
        elif key and key.group(1) in options:
            out[-1][1][key.group(1)] = options[key.group(1)]
    return [(h, opts) for h, opts in out if opts]


def page() -> str:
    """The whole of docs/configuration.md."""
    pins = dict(line.split("=", 1) for line in PINS.read_text().splitlines()
                if line and not line.startswith("#"))
    out = [INTRO.strip().replace("{pins}", f"torch {pins['TORCH_VERSION']}, DeepSpeed {pins['DEEPSPEED_VERSION']}")]
    spec_files = sorted(ROOT.glob("roles/*/meta/argument_specs.yml"),
                        key=lambda p: (p.parts[-3] != "plan", p.parts[-3]))
    for spec_file in spec_files:
        role = spec_file.parts[-3]
        for entry, spec in yaml.safe_load(spec_file.read_text())["argument_specs"].items():
            out.append(f"## {role}" if entry == "main" else f"## {role}: {entry}")
            out.append(markup(spec.get("short_description", "")))
            out += paragraphs(spec.get("description", []))
            options = spec.get("options") or {}
            if not options:
                out.append("No options.")
            for heading, opts in groups(spec_file, options) if options else []:
                table = ["| option | type | default | choices | description |", "|---|---|---|---|---|"]
                out.append("\n".join(([f"### {heading}", ""] if heading else []) + table + list(rows(opts))))
    return "\n\n".join(p for p in out if p).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = page()
    if argv[1:] == ["--check"]:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} differs from the argument specs. "
                  f"Fix: python3 scripts/config_doc.py > docs/configuration.md", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
