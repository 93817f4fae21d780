"""docs/configuration.md is what scripts/config_doc.py makes from the roles' argument specs."""
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_matches_the_argument_specs():
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_doc.py")], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == made, ("docs/configuration.md differs from roles/*/meta/argument_specs.yml. "
                          "Fix: python3 scripts/config_doc.py > docs/configuration.md")


def test_every_option_of_every_entry_point_is_on_the_page():
    page = (ROOT / "docs" / "configuration.md").read_text()
    for spec_file in ROOT.glob("roles/*/meta/argument_specs.yml"):
        for entry, spec in yaml.safe_load(spec_file.read_text())["argument_specs"].items():
            for name in spec.get("options") or {}:
                assert f"| `{name}` |" in page, f"{spec_file.parts[-3]} {entry}: {name} missing"
