"""What every ``prepare_*`` of :mod:`lab.collectives` makes, and the argument checks they share.

A collective is prepared in the caller (arguments checked, algorithm chosen, before any message)
and run later, in issue order: :class:`Prepared` holds its ``run`` and the :class:`Signature`
every rank must agree on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from lab import checks
from lab.ops import DType, ReduceOp
from lab.ops import parse_op as parse_any_op

if TYPE_CHECKING:
    from lab.mesh import Mesh

_OPS_BY_NAME = {o.value: o for o in ReduceOp}


def parse_op(op: Any) -> ReduceOp:
    """:func:`lab.ops.parse_op`, with the common lower-case names looked up directly."""
    return _OPS_BY_NAME.get(op) or parse_any_op(op) if isinstance(op, str) else parse_any_op(op)


def check_root(mesh: Mesh, root: Any, name: str) -> int:
    """``root`` as an int if it is a rank of ``mesh``, else a ``ValueError`` naming ``name``."""
    if not checks.is_int(root) or not 0 <= root < mesh.world_size:
        raise ValueError(f"{name} must be a rank in [0, {mesh.world_size}); got {root!r}")
    return int(root)



class Signature(NamedTuple):
    """What every rank must agree on for one collective: :meth:`lab.Mesh.collective`'s arguments
    (they make its fingerprint)."""

    collective: str
    algorithm: str
    dtype: DType
    count: int
    op: str = ""
    root: int = -1
    compiled: bool = True  # may take the compiled path (lab.plane) when small enough


class Prepared(NamedTuple):
    """A collective whose arguments are checked and whose algorithm is chosen: ``run()`` does its
    communication on the tensor's current contents and returns what the public call returns.
    ``planned()``, where given, makes a leaner ``run`` for a plan (the compiled call looked up
    once), or returns None where there is none."""

    run: Callable[[], Any]
    signature: Signature
    planned: Callable[[], Callable[[], Any] | None] | None = None


def compiled_run(mesh: Mesh, signature: Signature, algorithm: Any, args: tuple, after: Callable[[], Any],
                 in_place: bool = True) -> Callable[[], Any] | None:
    """A plan's run of the collective of ``signature``: ``algorithm`` on ``args`` through the
    compiled call made once, then ``after()`` (what the plain run returns); None where it would
    not run compiled, or where the buffers are not the caller's memory (``in_place`` False: a
    non-contiguous tensor, copied at each run)."""
    call = mesh.compiled_call(signature, algorithm, args) if in_place else None
    if call is None:
        return None
    operands = call.operands(args)

    def run() -> Any:
        call(operands)
        return after()

    return run


#: Kept per mesh at most (a program's distinct shapes of call are few; past this, start over).
MAX_REMEMBERED = 256


def remembered(mesh: Mesh, key: Any, make: Callable[[], Any]) -> Any:
    """``make()``, kept in ``mesh.templates`` under ``key``: what a plain call needs besides its
    tensor (checks passed, ``auto`` resolved, the compiled call looked up) is made once per
    distinct ``key``. ``key`` must hold every argument ``make`` depends on; an unhashable one
    (an algorithm given as a list, say) skips the memory and lets ``make`` raise."""
    templates = mesh.templates
    try:
        found = templates.get(key)
    except TypeError:
        return make()
    if found is None:
        found = make()
        if len(templates) >= MAX_REMEMBERED:
            templates.clear()
        templates[key] = found
    return found
