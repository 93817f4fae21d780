"""The one file the nodes run, built from this package: a zip application holding dscnode/ and, at
its top, __main__.py (the command line), behind a `#!/usr/bin/env python3` line. python3 runs a
zip file given as its script, and with mode 0755 it runs as a command:

    python3 -m dscnode.build OUT               # from node/: build OUT, print its sha256

The plan builds it on the control node, into the repository's .cache/ (plugins/module_utils/
dsc_plan.py: node_helper), and reinstalls it on a node whose copy has another sha256. The same
sources always give the same bytes: entries sorted, fixed timestamps and modes, stored
uncompressed (no zlib version can change them). This module stays on the control node."""
import hashlib
import io
import os
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SHEBANG = b"#!/usr/bin/env python3\n"
STAMP = (1980, 1, 1, 0, 0, 0)  # every entry's time: the earliest a zip file can hold


def archive():
    """The built file's bytes."""
    files = {"__main__.py": PACKAGE / "__main__.py"}
    files.update({f"{PACKAGE.name}/{p.name}": p for p in PACKAGE.glob("*.py") if p.name != "build.py"})
    out = io.BytesIO()
    out.write(SHEBANG)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, STAMP)
            info.create_system = 3  # Unix: the mode below is read
            info.external_attr = 0o644 << 16
            z.writestr(info, files[name].read_bytes())
    return out.getvalue()


def build(dest):
    """The built file at dest, mode 0755 (replaced atomically, left as it is when it already holds
    these bytes): its sha256."""
    data, dest = archive(), Path(dest)
    try:
        current = dest.read_bytes()
    except OSError:
        current = None
    if current != data:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o755)
            os.replace(tmp, dest)
        except BaseException:
            os.unlink(tmp)
            raise
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    print(build(sys.argv[1]))
