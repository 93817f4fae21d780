"""The control venv's lock (requirements/control.lock, written by scripts/lock.sh) holds every pin
of requirements/control.txt at the same version, each with a sha256."""
import re
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def test_the_lock_pins_what_control_txt_asks_for_with_hashes():
    lock = {}
    for line in (ROOT / "requirements" / "control.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+) --hash=sha256:[0-9a-f]{64}", line)
            assert m, f"not a hashed pin: {line}"
            lock[m.group(1).lower().replace("_", "-")] = m.group(2)
    for line in (ROOT / "requirements" / "control.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pinned = lock.get(req.name.lower().replace("_", "-"))
            assert pinned and req.specifier.contains(pinned), f"{line}: {pinned} in the lock; run scripts/lock.sh"
