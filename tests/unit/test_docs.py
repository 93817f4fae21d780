"""Every relative link in README.md and
docs/*.md points at a file that exists and, for a #anchor into a Markdown file, at one of its
headings (GitHub's anchors: lowercase, spaces to '-', other punctuation but '-' and '_' removed,
a repeated heading numbered -1, -2, ...)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def without_code_blocks(text):
    """The text without fenced or indented code blocks, where a '#' starts no heading."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return "\n".join(line for line in text.splitlines() if not line.startswith(("    ", "\t")))


def prose(text):
    """The text without code blocks and code spans, where links are not links."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def anchors(page):
    seen, out = {}, set()
    for line in without_code_blocks(page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_github_anchor_rules(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Runs\n## Launching without SSH (`dsc_launch_mode: no_ssh`)\n## Runs\n"
                    "### Run options (-e)\n    # not a heading\n")
    assert anchors(page) == {"runs", "launching-without-ssh-dsc_launch_mode-no_ssh", "runs-1",
                             "run-options--e"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)
