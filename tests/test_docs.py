"""The docs site's home page is the README, its links made relative to docs/: one text, no drift.

Regenerate it after editing the README: ``python tests/test_docs.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def home_page(readme: str) -> str:
    """README.md as docs/index.md: ``docs/x.md`` links relative; links to files outside docs/
    (results/REPORT.md) as their text, since the site does not hold them."""
    readme = re.sub(r"\]\(docs/", "](", readme)
    return re.sub(r"\[([^\]]+)\]\((?!https?:|#)([^)]*/[^)]*)\)", r"\1", readme)


def test_the_docs_home_page_is_the_readme():
    expected = home_page((ROOT / "README.md").read_text())
    assert (ROOT / "docs" / "index.md").read_text() == expected, "regenerate it: python tests/test_docs.py"


if __name__ == "__main__":
    (ROOT / "docs" / "index.md").write_text(home_page((ROOT / "README.md").read_text()))
