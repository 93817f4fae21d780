"""The control venv's lock (requirements/control.lock, written by scripts/lock.sh) holds every pin
of requirements/control.txt at the same version, each with a sha256."""
import hashlib
import json
import re
import subprocess
import sys
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


def test_hashlock_writes_the_index_hash_and_marks_source_archives(tmp_path):
    """scripts/hashlock.py (wheelhouse.sh, nodelock.sh, lock.sh): the index's sha256, else a local
    file's own; a source archive ends with '  # sdist' (built on the node without isolation)."""
    wheel = tmp_path / "tqdm-4.67.1-py3-none-any.whl"
    wheel.write_bytes(b"a local wheel")
    report = {"install": [
        {"metadata": {"name": "deepspeed", "version": "0.19.8"},
         "download_info": {"url": "https://files.example/deepspeed-0.19.8.tar.gz",
                           "archive_info": {"hashes": {"sha256": "a" * 64}}}},
        {"metadata": {"name": "tqdm", "version": "4.67.1"},
         "download_info": {"url": wheel.as_uri(), "archive_info": {}}},
    ]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "hashlock.py"), str(tmp_path / "report.json"),
                    str(tmp_path / "out.lock"), "a header"], check=True, capture_output=True)
    assert (tmp_path / "out.lock").read_text().splitlines() == [
        "# a header",
        f"deepspeed==0.19.8 --hash=sha256:{'a' * 64}  # sdist",
        f"tqdm==4.67.1 --hash=sha256:{hashlib.sha256(b'a local wheel').hexdigest()}",
    ]
