"""What the layers above ask of a mesh (lab.comm.protocols, lab.algorithms.peers.Peers) is what
lab.Mesh and the simulator's recorder give, member by member, and what the public calls and the
torch backend use of a mesh is declared there, no more and no less. Classes are inspected
(``inspect.getattr_static``, nothing constructed), modules parsed (``ast``): no rank starts.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, Generic, Protocol

import pytest

from lab.algorithms.peers import GroupView, Peers
from lab.comm.exchange import Exchange
from lab.comm.mesh import Mesh
from lab.comm.protocols import BackendMesh, CallMesh
from lab.sim.schedule import RecordingMesh

pytestmark = pytest.mark.no_ranks

ROOT = Path(__file__).resolve().parent.parent
#: The public calls' modules, and the torch backend's.
CALL_MODULES = [
    ROOT / "lab" / "collectives" / f"{name}.py"
    for name in ("calls", "prepared", "gather_scatter", "plans", "choice")]
BACKEND_MODULES = sorted((ROOT / "lab" / "backend").glob("*.py"))
#: The names a mesh goes by in those modules (``world``: the backend's world; its ``group`` is torch's).
MESH_NAMES = {"mesh", "world"}
MESH_ATTRIBUTES = {"mesh", "_mesh"}  # self.mesh, self._mesh


def declared(protocol: type) -> dict[str, Any]:
    """A protocol's members (its own and its bases'), by name: a function, a property, a
    staticmethod, or ``None`` for a data member declared by annotation."""
    members: dict[str, Any] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol, Generic):
            continue
        members.update({name: None for name in inspect.get_annotations(cls)})
        members.update({
            name: value
            for name, value in cls.__dict__.items() if not name.startswith("_") and
            (isinstance(value, (property, staticmethod)) or inspect.isfunction(value))})
    return members


def annotated(cls: type) -> set[str]:
    """Data members a class declares by annotation (its own and its bases')."""
    return {name for c in cls.__mro__ for name in inspect.get_annotations(c)}


def parameters(member: Any) -> list[inspect.Parameter]:
    """A method's parameters as its callers pass them (without ``self``)."""
    if isinstance(member, staticmethod):
        return list(inspect.signature(member.__func__).parameters.values())
    return list(inspect.signature(member).parameters.values())[1:]


def signature_problems(name: str, wanted: Any, given: Any) -> list[str]:
    """Where ``given`` cannot be called as ``wanted`` is declared: a parameter missing, moved or
    of another kind, a default the callers rely on missing, or one more parameter they do not pass."""
    problems = []
    want, have = parameters(wanted), parameters(given)
    by_name = {p.name: p for p in have}
    positional = [p for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, p in enumerate(want):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if not any(h.kind == p.kind for h in have):
                problems.append(f"{name}: takes no {'*' if p.kind == p.VAR_POSITIONAL else '**'}{p.name}")
            continue
        found = by_name.get(p.name)
        if found is None:
            problems.append(f"{name}: no parameter {p.name!r}")
        elif p.kind == p.POSITIONAL_OR_KEYWORD and (index >= len(positional) or
                                                    positional[index] is not found):
            problems.append(f"{name}: {p.name!r} is not its parameter {index + 1}")
        elif p.kind == p.KEYWORD_ONLY and found.kind not in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            problems.append(f"{name}: {p.name!r} cannot be passed by keyword")
        elif p.default is not p.empty and found.default is p.empty:
            problems.append(f"{name}: {p.name!r} has no default")
    wanted_names = {p.name for p in want}
    problems += [
        f"{name}: its parameter {h.name!r}, which callers do not pass, has no default" for h in have
        if h.name not in wanted_names and h.default is h.empty and h.kind not in (h.VAR_POSITIONAL,
                                                                                  h.VAR_KEYWORD)]
    return problems


def conformance(implementation: Any, protocol: type) -> list[str]:
    """Where ``implementation`` (a class, or an instance for members set in ``__init__``) does
    not give a member of ``protocol`` as declared: missing, a method where a value is declared or
    the other way round, or a method its callers cannot call as they do."""
    cls = implementation if isinstance(implementation, type) else type(implementation)
    problems = []
    for name, wanted in declared(protocol).items():
        try:
            given = inspect.getattr_static(implementation, name)
        except AttributeError:
            if wanted is None and name in annotated(cls):
                continue
            problems.append(f"{name}: missing")
            continue
        is_method = inspect.isfunction(given) or isinstance(given, (staticmethod, classmethod))
        if wanted is None or isinstance(wanted, property):
            if is_method:
                problems.append(f"{name}: a method, declared a value")
        elif not is_method:
            problems.append(f"{name}: not a method ({type(given).__name__})")
        else:
            problems += signature_problems(name, wanted, given)
    return problems


@pytest.mark.parametrize(("implementation", "protocol"), [
    (Mesh, CallMesh),
    (Mesh, BackendMesh),
    (Mesh, Peers),
    (RecordingMesh(4, 2), CallMesh),
    (RecordingMesh, Peers),
    (Exchange, Peers),
    (GroupView(RecordingMesh(4), [3, 0]), Peers),],
                         ids=lambda value: getattr(value, "__name__",
                                                   type(value).__name__))
def test_each_implementation_gives_every_declared_member(implementation: Any, protocol: type):
    assert conformance(implementation, protocol) == []


def used_members(paths: list[Path]) -> dict[str, list[str]]:
    """Every member used of a mesh in ``paths``, with where."""
    used: dict[str, list[str]] = {}
    for path in paths:
        for name, where in scan(path).items():
            used.setdefault(name, []).extend(f"{path.relative_to(ROOT)}:{line}" for line in where)
    return used


def scan(path: Path) -> dict[str, list[int]]:
    """Every member used of a mesh in the module ``path`` (``mesh.x``, ``self.mesh.x``,
    ``getattr(mesh, "x", ...)``), with the lines."""
    used: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        owner, name = None, None
        if isinstance(node, ast.Attribute):
            owner, name = node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            owner, name = node.args[0], node.args[1].value
        is_mesh = isinstance(owner, ast.Name) and owner.id in MESH_NAMES or \
            isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and \
            owner.value.id == "self" and owner.attr in MESH_ATTRIBUTES
        if is_mesh:
            used.setdefault(name, []).append(node.lineno)
    return used


def test_the_public_calls_use_exactly_what_call_mesh_declares():
    used, members = used_members(CALL_MODULES), set(declared(CallMesh))
    assert {name: where for name, where in used.items() if name not in members} == {}, "used but not declared"
    assert members - set(used) == set(), "declared but not used by the public calls"


def test_the_backend_uses_exactly_what_backend_mesh_declares_besides():
    used = used_members(BACKEND_MODULES)
    own = set(declared(BackendMesh)) - set(declared(CallMesh)) | {"issue"}  # (issue: with p2p= there)
    assert {name: where for name, where in used.items() if name not in declared(BackendMesh)} == {}, \
        "used but not declared"
    assert own - set(used) == set(), "declared but not used by the backend"


class Planted(Protocol):
    size: int

    def go(self, a: int, b: int = 0, *, c: str = "") -> None:
        ...


class Conforming:
    size = 1

    def go(self, a: int, b: int = 0, d: int = 5, *, c: str = "") -> None:
        ...


class Missing:
    def go(self, a: int, b: int = 0, *, c: str = "") -> None:
        ...


class Misnamed:
    size = 1

    def go(self, a: int, bee: int = 0, *, c: str = "") -> None:
        ...


class NoDefault:
    size = 1

    def go(self, a: int, b: int, *, c: str = "") -> None:
        ...


class ExtraRequired:
    size = 1

    def go(self, a: int, b: int = 0, *, c: str = "", e: int) -> None:
        ...


def test_the_check_fails_a_member_missing_or_called_otherwise():
    """The check can fail: each planted difference from a protocol is found, and none where the
    class conforms (an extra parameter with a default is fine)."""
    assert conformance(Conforming, Planted) == []
    assert conformance(Missing, Planted) == ["size: missing"]
    assert conformance(Misnamed, Planted) == ["go: no parameter 'b'"]
    assert conformance(NoDefault, Planted) == ["go: 'b' has no default"]
    assert conformance(ExtraRequired,
                       Planted) == ["go: its parameter 'e', which callers do not pass, has no default"]


def test_the_scan_finds_every_form_of_use(tmp_path: Path):
    """A planted module's uses of a mesh are each found, under every name it goes by, and
    nothing else is taken for one."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f(mesh, world, other):\n    mesh.a; world.b(); getattr(mesh, 'c', 0); other.d\n"
                       "class G:\n    def g(self):\n        self.mesh.e; self._mesh.f; self.other.h\n")
    assert scan(planted) == {"a": [2], "b": [2], "c": [2], "e": [5], "f": [5]}
