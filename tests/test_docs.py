"""The docs against the repository.

The site's home page is the README, its links made relative to docs/: one text, no drift.
Regenerate it after editing the README: ``python tests/test_docs.py``. docs/layout.md maps every
module, one line each: a module without its line, or a line without its file, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_ranks

ROOT = Path(__file__).resolve().parent.parent

#: The packages whose every module docs/layout.md gives a line.
MAPPED_PACKAGES = ("lab", "kernels", "bench", "examples")
#: A layout line: ``- `path`: what it owns``.
LAYOUT_LINE = re.compile(r"^- `([^`]+)`:", re.MULTILINE)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def home_page(readme: str) -> str:
    """README.md as docs/index.md: ``docs/x`` links and pictures relative to docs/; links to files
    outside docs/ (results/REPORT.md) as their text, since the site does not hold them."""
    readme = re.sub(r"(?<!!)\[([^\]]+)\]\((?!https?:|#|docs/)([^)]*/[^)]*)\)", r"\1", readme)
    return re.sub(r"\]\(docs/", "](", readme)


def layout_problems(root: Path, layout: str) -> list[str]:
    """What ``layout`` (docs/layout.md's text) gets wrong about the tree at ``root``: a module of
    :data:`MAPPED_PACKAGES` without its line, a line twice, a line naming a path that does not exist."""
    named = LAYOUT_LINE.findall(layout)
    modules = {
        path.relative_to(root).as_posix()
        for package in MAPPED_PACKAGES
        for path in (root / package).rglob("*.py")}
    problems = [f"{module}: no line in docs/layout.md" for module in sorted(modules - set(named))]
    problems += [f"{path}: named twice" for path in sorted({p for p in named if named.count(p) > 1})]
    return problems + [f"{path}: not in the repository" for path in named if not (root / path).exists()]


def test_the_docs_home_page_is_the_readme():
    expected = home_page((ROOT / "README.md").read_text())
    assert (ROOT / "docs" / "index.md").read_text() == expected, "regenerate it: python tests/test_docs.py"


def test_the_home_page_keeps_the_readmes_pictures_and_they_exist_on_the_site():
    readme = (ROOT / "README.md").read_text()
    pictures = IMAGE.findall(home_page(readme))
    assert len(pictures) == len(IMAGE.findall(readme)) > 0
    assert [path for path in pictures if not (ROOT / "docs" / path).is_file()] == []


def test_the_home_page_drops_links_outside_docs_and_keeps_links_and_pictures_inside():
    readme = "[a](docs/a.md#x), [R](results/R.md), [w](https://w.org/p), ![p](docs/img/p.png)"
    assert home_page(readme) == "[a](a.md#x), R, [w](https://w.org/p), ![p](img/p.png)"


def test_the_layout_maps_every_module_and_names_only_files_that_exist():
    assert layout_problems(ROOT, (ROOT / "docs" / "layout.md").read_text()) == []


def test_a_layout_that_misses_a_module_or_names_a_missing_file_fails(tmp_path: Path):
    for module in ("lab/comm/mesh.py", "lab/sim/core.py", "kernels/reduce.py", "bench/conftest.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    complete = "- `lab/comm/mesh.py`: Mesh\n- `lab/sim/core.py`: simulate\n- `kernels/reduce.py`: kernels\n"
    complete += "- `bench/conftest.py`: the harness\n"
    assert layout_problems(tmp_path, complete) == []
    missing_one = complete.replace("- `lab/sim/core.py`: simulate\n", "")
    assert layout_problems(tmp_path, missing_one) == ["lab/sim/core.py: no line in docs/layout.md"]
    stale = complete + "- `lab/gone.py`: moved away\n- `lab/comm/mesh.py`: Mesh again\n"
    assert layout_problems(tmp_path,
                           stale) == ["lab/comm/mesh.py: named twice", "lab/gone.py: not in the repository"]


if __name__ == "__main__":
    (ROOT / "docs" / "index.md").write_text(home_page((ROOT / "README.md").read_text()))
