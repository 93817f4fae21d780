"""Make the repository root (for `train.*`) and plugins/module_utils importable from unit tests."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "plugins" / "module_utils"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
