"""The guard on Numba's disk cache (kernels.cache): an edit in a helper file never leaves stale
compiled code running, and the lab's list of compiled sources misses none."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import child_env

from kernels import cache
from lab.compiled.sources import ROOT, SOURCES

pytestmark = pytest.mark.no_ranks

#: Code that Numba compiles: a decorated function, or a dispatcher made with njit(...).
COMPILED = re.compile(r"^\s*@(compilable|njit|numba\.njit)\b|\bnjit\([^)]*\)\(", re.MULTILINE)

ENTRY = """
from numba import njit
import helper

@njit(cache=True)
def entry():
    return helper.value()
"""
HELPER = """
from numba import njit

@njit(cache=True)
def value():
    return {value}
"""
RUN = """
import sys
from pathlib import Path
if sys.argv[1] == "guarded":
    from kernels import cache
    cache.guard("plane", sorted(Path(".").glob("*.py")))
import entry
print(entry.entry())
"""


def run(folder: Path, guarded: bool) -> int:
    """``entry()`` in a fresh process (so from the disk cache where there is one)."""
    done = subprocess.run([sys.executable, "run.py", "guarded" if guarded else "plain"], cwd=folder,
                          text=True, capture_output=True, timeout=120, env=child_env(NUMBA_CACHE_DIR=""))
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def program(folder: Path, value: int) -> None:
    (folder / "entry.py").write_text(ENTRY)
    (folder / "helper.py").write_text(HELPER.format(value=value))
    (folder / "run.py").write_text(RUN)


def test_an_edit_in_a_helper_file_recompiles_what_calls_it(tmp_path, monkeypatch):
    monkeypatch.setattr("numba.config.CACHE_DIR", "")  # where the programs cache (run's NUMBA_CACHE_DIR="")
    stale, guarded = tmp_path / "stale", tmp_path / "guarded"
    for folder in (stale, guarded):
        folder.mkdir()
        program(folder, 1)
        assert run(folder, folder is guarded) == 1
        (folder / "helper.py").write_text(HELPER.format(value=2) + "\n# edited\n")
    assert run(stale, False) == 1  # what the guard is for: Numba's own check sees only entry.py
    assert run(guarded, True) == 2
    assert run(guarded, True) == 2  # and the new code is cached again
    assert (cache.cache_dir(guarded / "entry.py") / "plane.sources.sha256").read_text() == \
        cache.digest(sorted(guarded.glob("*.py")))


def test_the_guard_clears_only_its_sources_and_only_on_a_change(tmp_path, monkeypatch):
    monkeypatch.setattr("numba.config.CACHE_DIR", str(tmp_path / "numba"))
    source, other = tmp_path / "mine.py", tmp_path / "mine_too.py"
    source.write_text("x = 1\n")
    other.write_text("y = 1\n")
    folder = cache.cache_dir(source)
    assert cache.guard("g", [source]) and not cache.guard("g", [source])
    names = ("mine.f-1.py311.nbi", "mine.f-1.py311.1.nbc", "mine_too.g-1.py311.nbi")
    compiled = [folder / name for name in names]
    for path in compiled:
        path.write_bytes(b"")
    assert not cache.guard("g", [source]) and all(path.exists() for path in compiled)
    source.write_text("x = 2\n")
    assert cache.guard("g", [source])
    assert [path.exists() for path in compiled] == [False, False, True]  # mine_too.py is not of the group


def compiled_modules(root: Path = ROOT) -> dict[str, set[str]]:
    """Each lab/kernels source under ``root`` with compiled code, and the lab/kernels sources it imports."""
    found = {}
    for path in sorted([*(root / "lab").rglob("*.py"), *(root / "kernels").glob("*.py")]):
        text = path.read_text()
        if not COMPILED.search(text):
            continue
        imported = set()
        for node in ast.parse(text).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lab", "kernels"):
                module = root / node.module.replace(".", "/")
                for alias in node.names:
                    target = module / f"{alias.name}.py" if (module / f"{alias.name}.py").exists() else \
                        module.with_suffix(".py")
                    if target.exists():
                        imported.add(str(target.relative_to(root)))
        found[str(path.relative_to(root))] = imported
    return found


def test_every_compiled_source_and_what_it_imports_is_guarded():
    modules = compiled_modules()
    assert "lab/compiled/plane.py" in modules and "lab/algorithms/fold.py" in modules  # the scan finds them
    missing = {name for source, imported in modules.items() for name in {source, *imported}} - set(SOURCES)
    assert not missing, f"lab/compiled/sources.py's SOURCES misses {sorted(missing)}"
    assert all((ROOT / source).exists() for source in SOURCES)


def test_the_scan_sees_a_compiled_module_and_what_it_imports(tmp_path):
    """The check above cannot pass by missing files: a planted compiled module is found, with the
    constant's module it imports."""
    (tmp_path / "lab" / "collectives").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "lab" / "limits.py").write_text("LIMIT = 3\n")
    (tmp_path / "lab" / "collectives" / "planted.py").write_text(
        textwrap.dedent("""
        from lab.compiled import compilable
        from lab.limits import LIMIT

        @compilable
        def planted(peers):
            return LIMIT
    """))
    assert compiled_modules(tmp_path) == {"lab/collectives/planted.py": {"lab/limits.py"}}


#: In a fresh process: the reduction kernel sum_into's signatures loaded from the cache, and compiled.
CACHE_USE = ("import lab, kernels.reduce as r; s = r.sum_into.stats; "
             "print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))")


@pytest.mark.slow  # (the first import compiles every reduction kernel: about 9 CPU seconds)
def test_what_a_first_import_compiles_the_next_process_loads(tmp_path):
    """With an empty cache, ``import lab`` compiles the reduction kernels and the next process
    loads them: the guard runs before any import compiles (it once ran after, cleared what the
    first run had just compiled, and left the second to compile it all again)."""
    counts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CACHE_USE], capture_output=True, text=True, timeout=300,
                              env=child_env(NUMBA_CACHE_DIR=str(tmp_path)))
        assert done.returncode == 0, done.stderr
        counts.append(tuple(map(int, done.stdout.split()[-2:])))
    (first_hits, compiled), second = counts
    assert first_hits == 0 and compiled > 0 and second == (compiled, 0), counts
