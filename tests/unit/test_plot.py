"""plugins/module_utils/dsc_plot.py: a real PNG from two runs' histories (matplotlib, no node)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_runs_make_one_png_with_both(tmp_path):
    histories = {
        "zero2-a": [{"step": s, "loss": 5 - s / 10, "tokens_per_s": 1000 + s} for s in range(1, 30)],
        "own-clm": [{"step": s, "loss": 6 - s / 20, "samples_per_s": 12.5} for s in range(1, 20)]
                   + [{"step": 20, "loss": None}],
    }
    out = tmp_path / "runs.png"
    r = subprocess.run([sys.executable, str(ROOT / "plugins" / "module_utils" / "dsc_plot.py"), str(out)],
                       input=json.dumps(histories), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"path": str(out), "runs": ["zero2-a", "own-clm"], "points": 48}
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000  # a real picture, not an empty frame
