"""The packages' shape: small modules, classes and functions, no private name used across
modules, no import circle, and ``kernels/`` importing nothing from ``lab``. Every module under
``lab/`` and ``kernels/`` is parsed with ``ast`` (nothing is imported), so a failure names the
file, the line and the rule.

- A module is at most ``MAX_MODULE_LINES`` lines, a class at most ``MAX_CLASS_LINES``, a function
  at most ``MAX_FUNCTION_LINES``.
- A private name (``_x``) of a module is used only inside it: no ``from lab.x import _y``, no
  ``module._y`` on an imported module of ours, and no ``obj._y`` where ``_y`` is a private name
  some other module of ours defines and this one does not (attributes of ``self``/``cls`` are the
  module's own; another library's private names, torch's, are not this test's business).
- Imports between our modules form no circle. Every import counts: at module level, under ``if
  TYPE_CHECKING:`` (a type hint that runs back up is a circle in the design) and inside functions
  (an import deferred to call time is still a dependency). Importing ``lab.p.q`` runs the
  package ``lab.p``'s ``__init__`` first, so it counts as an import of ``lab.p`` too (of every
  package above ``q`` but the top one, ``lab`` or ``kernels``, whose ``__init__`` is the public
  face that every module of it runs under anyway, and but the importer's own packages, which are
  running already). ``from lab.p import name`` counts as an import of ``lab.p.name`` where that
  is a module.
- Packages stand on floors: the parts of ``lab`` (each subpackage, each loose module) and
  ``kernels``, with every import between two modules counted as an arrow between their parts,
  form no circle either, so every part can be given a floor with all its arrows running down
  (``lab.collectives`` -> ``lab.tuning`` -> ``lab.algorithms``, never back up). The package
  ``lab`` itself, the public face, stands above them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_ranks

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lab", "kernels")
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60

#: Known exceptions, each with its reason: {(rule, module): reason}. They are expected failures
#: (strict): once the module complies, its entry must go.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("function size", "lab.sim.event_loop"): "_replay is the simulator's event loop, compiled by Numba: its state is "
    "some 30 arrays, and its steps are already helpers (_wire, _receive, _complete, _cpu) that take them as arguments"
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(root: Path) -> dict[str, Path]:
    """Every module of our packages under ``root``, by dotted name."""
    return {module_name(p, root): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


MODULES = modules_under(ROOT)
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def resolve(module: str, level: int, current: str, modules: dict[str, Path] = MODULES) -> str:
    """The absolute name of ``from <level dots><module> import ...`` inside ``current``."""
    if not level:
        return module
    package = current if modules[current].name == "__init__.py" else current.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, assignments, attributes it sets on
    ``self``/``cls`` (setting ``other._x`` does not make ``_x`` this module's)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if is_private(n)}


PRIVATE_NAMES = {name: defined_private_names(tree) for name, tree in TREES.items()}


def lab_module_aliases(tree: ast.Module, current: str) -> dict[str, str]:
    """Local names bound to lab modules anywhere in ``tree`` (``from lab import fingerprint``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node.module or "", node.level, current)
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def private_uses(current: str, tree: ast.Module, private_names: dict[str, set[str]]) -> list[str]:
    """Where module ``current`` (parsed: ``tree``) uses another lab module's private name
    (``private_names``: each module's own)."""
    own = private_names.get(current, set())
    others = set().union(*(names for name, names in private_names.items() if name != current)) - own
    aliases = lab_module_aliases(tree, current)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = resolve(node.module or "", node.level, current)
            if base.partition(".")[0] in PACKAGES:
                found += [
                    f"line {node.lineno}: from {base} import {a.name}" for a in node.names
                    if is_private(a.name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in ("self", "cls"):
                continue
            if owner in aliases:
                if aliases[owner] != current:
                    found.append(f"line {node.lineno}: {owner}.{node.attr} ({aliases[owner]}'s private name)")
            elif node.attr in others:
                found.append(f"line {node.lineno}: .{node.attr} (another lab module's private name)")
    return found


def packages_run(name: str, importer: str) -> list[str]:
    """What importing ``name`` runs besides it: the packages above it, less the top one and the
    importer's own (see the module's docstring)."""
    parts = name.split(".")
    above = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [p for p in above if not importer.startswith(p + ".")]


def import_graph(modules: dict[str, Path] = MODULES, trees: dict[str,
                                                                 ast.Module] = TREES) -> dict[str, set[str]]:
    """Module -> the modules of ours that importing it runs, one step (every import counts)."""
    graph = {name: set() for name in modules}
    for current, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(node.module or "", node.level, current, modules)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                graph[current] |= {
                    t
                    for t in (target, *packages_run(target, current))
                    if t in modules and t != current and not current.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def part_of(module: str) -> str:
    """The part of the house ``module`` belongs to: ``lab.comm.mesh`` -> ``lab.comm``, ``lab.tuning`` ->
    ``lab.tuning``, ``kernels.rings`` -> ``kernels``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "lab" else parts[0]


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen from above: part -> the parts its modules import (``lab`` left out)."""
    parts = {part_of(m) for m in graph} - {"lab"}
    return {
        part: {part_of(t)
               for m, targets in graph.items() if part_of(m) == part for t in targets} - {part, "lab"}
        for part in parts}


def each_module(rule: str) -> list:
    """Every module, those excepted from ``rule`` marked as expected failures with the reason."""
    return [
        pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=EXCEPTIONS[rule, m])) if
        (rule, m) in EXCEPTIONS else m for m in sorted(MODULES)]


def oversized(path: Path, tree: ast.Module) -> list[str]:
    """What in the module at ``path`` is over the size rules for modules and classes."""
    lines = len(path.read_text().splitlines())
    too_long = [f"{path.name}: {lines} lines > {MAX_MODULE_LINES}"] if lines > MAX_MODULE_LINES else []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
            too_long.append(
                f"class {node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines "
                f"> {MAX_CLASS_LINES}")
    return too_long


@pytest.mark.parametrize("module", each_module("size"))
def test_module_and_classes_are_small(module):
    too_long = oversized(MODULES[module], TREES[module])
    assert not too_long, f"{MODULES[module].relative_to(ROOT)}: " + "; ".join(too_long)


@pytest.mark.parametrize("module", each_module("function size"))
def test_functions_are_short(module):
    too_long = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines > {MAX_FUNCTION_LINES}"
        for node in ast.walk(TREES[module])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno +
        1 > MAX_FUNCTION_LINES]
    assert not too_long, f"{MODULES[module].relative_to(ROOT)}: " + "; ".join(too_long)


@pytest.mark.parametrize("module", each_module("private"))
def test_no_private_name_across_modules(module):
    found = private_uses(module, TREES[module], PRIVATE_NAMES)
    assert not found, f"{module} uses private names of other modules: {found}"


def test_no_import_circle():
    assert not circles(import_graph()), f"import circles: {circles(import_graph())}"


def test_no_package_imports_one_on_a_floor_above():
    assert not circles(part_graph(import_graph())), f"package circles: {circles(part_graph(import_graph()))}"


def test_kernels_import_nothing_from_lab():
    found = [
        f"{name} imports {target}" for name, targets in import_graph().items() if name.startswith("kernels")
        for target in targets if target.startswith("lab")]
    assert not found, found


def defaults_of_compiled(tree: ast.Module) -> list[str]:
    """The public ``njit`` functions of a module (those Python may call) that give a parameter a
    default. Numba dispatches a call from Python that leaves one out through its slow path, every
    time: ``kernels.two_shot.wait_all`` cost the Python path's two-shot about 100 µs a wait this way
    (2 µs with every argument given). The private ones are called from compiled code only."""
    return [
        f"{node.name} (line {node.lineno})" for node in tree.body
        if isinstance(node, ast.FunctionDef) and not is_private(node.name) and
        (node.args.defaults or any(node.args.kw_defaults)) and any("njit" in ast.unparse(decorator)
                                                                   for decorator in node.decorator_list)]


def test_compiled_functions_that_python_calls_take_every_argument():
    found = {name: defaults_of_compiled(tree) for name, tree in TREES.items() if defaults_of_compiled(tree)}
    assert not found, f"public njit functions with defaults: {found}"
    planted = ast.parse("@njit(cache=True)\ndef f(a, b=1):\n    pass\n\n\n@njit\ndef _g(a, b=1):\n    pass\n")
    assert defaults_of_compiled(planted) == ["f (line 2)"]


def plant(root: Path, files: dict[str, str]) -> tuple[dict[str, Path], dict[str, ast.Module]]:
    """Write ``files`` (path: source) under ``root``; its modules and their trees."""
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    modules = modules_under(root)
    return modules, {name: ast.parse(path.read_text()) for name, path in modules.items()}


def test_a_planted_circle_through_a_function_or_a_package_is_found(tmp_path: Path):
    """A circle closed by an import inside a function, and one closed by a package's
    ``__init__`` (importing ``lab.p.registry`` runs ``lab/p/__init__.py``), both fail the rule."""
    modules, trees = plant(
        tmp_path, {
            "lab/__init__.py": "", "kernels/__init__.py": "",
            "lab/low.py": "def advise():\n    from lab.high import answer\n",
            "lab/high.py": "from lab import low\n", "lab/p/__init__.py": "from lab.p import choice\n",
            "lab/p/registry.py": "", "lab/p/choice.py": "from lab import tuning\n",
            "lab/tuning.py": "from lab.p import registry\n"})
    assert circles(import_graph(modules, trees)) == [["lab.high", "lab.low"],
                                                     ["lab.p", "lab.p.choice", "lab.tuning"]]


def test_a_planted_arrow_back_up_between_packages_is_found(tmp_path: Path):
    """Two packages whose modules import each other's, with no circle between modules, fail the
    floor rule, and so does a loose module a package imports that imports the package back."""
    modules, trees = plant(
        tmp_path, {
            "lab/__init__.py": "", "kernels/__init__.py": "", "lab/p/__init__.py": "",
            "lab/p/a.py": "from lab.q import b\n", "lab/p/d.py": "", "lab/q/__init__.py": "",
            "lab/q/b.py": "", "lab/q/c.py": "from lab.p import d\n", "lab/r/__init__.py": "",
            "lab/r/choice.py": "from lab import tuning\n", "lab/r/registry.py": "",
            "lab/tuning.py": "from lab.r import registry\n"})
    assert not circles(import_graph(modules, trees))
    assert circles(part_graph(import_graph(modules, trees))) == [["lab.p", "lab.q"], ["lab.r", "lab.tuning"]]


def test_a_planted_451_line_kernel_module_is_too_long(tmp_path: Path):
    modules, trees = plant(tmp_path, {
        "lab/__init__.py": "", "kernels/__init__.py": "", "kernels/big.py": "x = 1\n" *
        (MAX_MODULE_LINES + 1)})
    assert oversized(modules["kernels.big"], trees["kernels.big"]) == ["big.py: 451 lines > 450"]
    assert "kernels.mailbox" in MODULES  # the real kernels are under the rules


def test_the_checker_catches_what_it_should():
    """The rules fire on a circle, a private import and a private attribute (so they can fail)."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not circles({"a": {"b"}, "b": set()})
    probe = ast.parse("from lab.comm.mesh import _x\nimport lab.fingerprint as fp\nfp._y\nobj._z\nself._w\n")
    found = private_uses("lab.probe", probe, {**PRIVATE_NAMES, "lab.probe": set(), "lab.other": {"_z"}})
    assert [f.partition(": ")[0] for f in found] == ["line 1", "line 3", "line 4"], found
