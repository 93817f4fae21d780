"""A hashed lock from pip's installation report (`pip install --dry-run --report FILE`): one
`name==version --hash=sha256:...` line per package, for `pip install --require-hashes`. The hash
is the index's, else (a local wheelhouse) the file's own. A package that resolved to a source
archive (DeepSpeed on PyPI) ends with `  # sdist`: nodes build it without build isolation, from
the lock's own setuptools (pip does not hash-check an isolated build's dependencies).
    python scripts/hashlock.py REPORT OUT "header line" ...
"""
import hashlib
import json
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse


def sha256(item):
    info = item["download_info"]
    known = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
    if known:
        return known
    url = urlparse(info["url"])
    if url.scheme != "file":
        sys.exit(f"no sha256 for {info['url']} (not a local file and the index gave none)")
    return hashlib.sha256(Path(unquote(url.path)).read_bytes()).hexdigest()


def main(report, out, *header):
    items = sorted(json.load(open(report))["install"], key=lambda i: i["metadata"]["name"].lower())
    lines = [f"# {h}" for h in header] + [
        f"{i['metadata']['name']}=={i['metadata']['version']} --hash=sha256:{sha256(i)}"
        + ("" if urlparse(i["download_info"]["url"]).path.endswith(".whl") else "  # sdist") for i in items]
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"{len(items)} packages pinned with hashes in {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
