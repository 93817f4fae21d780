"""One import mechanism: the project's Python imports itself through the control venv's
dscluster.pth (scripts/setup-control.sh), never by editing sys.path or loading a file by its path;
and the plan stays a package of modules one can hold in one's head."""
from pathlib import Path

import dscplan

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("plugins", "node", "tests", "molecule", "bench", "train", "scripts")
# The places that keep one, each with its reason.
KEPT = {
    # A user's package in a temporary directory, imported to test the entry shim's import patches:
    # the user's code, not the project's.
    "tests/unit/test_node_entry.py": "sys.path.insert",
}
WORDS = ("sys.path.insert", "spec_from_file_location")


def test_no_sys_path_edits_or_loads_by_path():
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("tests/fixtures/") or path == Path(__file__):
                continue
            text = path.read_text(encoding="utf-8")
            found += [f"{rel}: {w}" for w in WORDS if w in text and KEPT.get(rel) != w]
    assert found == [], "import through the venv's dscluster.pth instead:\n" + "\n".join(found)


def test_every_module_of_the_plan_is_at_most_600_lines():
    package = Path(dscplan.__file__).parent
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in package.glob("*.py")}
    assert len(sizes) > 5
    assert {name: n for name, n in sizes.items() if n > 600} == {}


def test_the_setup_writes_the_one_import_path():
    script = (ROOT / "scripts" / "setup-control.sh").read_text()
    assert "dscluster.pth" in script
