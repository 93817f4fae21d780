"""Make the repository root (for `train.*`), plugins/module_utils and the node helper (node/)
importable from unit tests."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "plugins" / "module_utils", ROOT / "node"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
