"""The fingerprint every message carries: which mesh, which collective, and its arguments.

32 bytes, the transports' ``TAG_BYTES``: context (0: the root mesh; a sub-mesh's id),
point-to-point tag (0 for collectives), sequence number, collective, algorithm, dtype code, reduce
op, root (-1: none), element count. Context and tag come first: a transport parks a message whose
first ``CONTEXT_BYTES`` differ from the receive's (another mesh's, or a send of another tag), as
MPI matches by communicator, source and tag. Ranks in different collectives, or with different arguments, are
caught at their first message by comparing fingerprints.

Algorithm codes are registered by :mod:`lab.algorithms.registry` (this module imports no
algorithm), unique within a collective.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from lab.ops import DTYPES_BY_CODE, DType

#: Wire codes: a collective's position in this tuple (0: point-to-point). The last two are the lab's
#: own, which no user call makes: split (Mesh.split's exchange) and agree (ranks comparing their
#: fingerprints: a plan's at init, a rooted collective's at its first call; Exchange.agree).
COLLECTIVES = ("send/recv", "allreduce", "broadcast", "allgather", "reduce_scatter", "reduce", "all_to_all",
               "barrier", "gather", "scatter", "split", "agree")
#: The collectives a program calls (and registers algorithms for).
PUBLIC_COLLECTIVES = COLLECTIVES[1:-2]
REDUCE_OPS = ("", "sum", "prod", "min", "max", "avg", "band", "bor", "bxor")

FINGERPRINT = struct.Struct("<IiQBBBBiq")
#: Where the sequence number lies (a plan writes its fingerprint once, then only this 8-byte word).
SEQ_OFFSET = struct.calcsize("<Ii")
#: Sub-mesh context ids are 4 bytes.
MAX_CONTEXT = 2**32 - 1
#: Point-to-point tags are in [0, MAX_TAG] (MPI's ``MPI_TAG_UB``).
MAX_TAG = 2**31 - 1

_ALGORITHM_CODES: dict[tuple[str, str], int] = {}
_ALGORITHM_NAMES: dict[tuple[int, int], str] = {}


def register_algorithm(collective: str, name: str, code: int) -> None:
    """Give ``collective``'s algorithm ``name`` the wire code ``code`` (1-255, unique per collective)."""
    key = (COLLECTIVES.index(collective), code)
    if not 1 <= code <= 255 or _ALGORITHM_NAMES.get(key, name) != name:
        raise ValueError(f"{collective} algorithm {name!r}: wire code {code} is out of range or taken")
    _ALGORITHM_CODES[collective, name] = code
    _ALGORITHM_NAMES[key] = name


def pack(context: int, seq: int, collective: str, algorithm: str, dtype_code: int, op: str, root: int,
         count: int) -> bytes:
    """The fingerprint of one collective's messages (``algorithm`` "": none, as in a split)."""
    code = _ALGORITHM_CODES[collective, algorithm] if algorithm else 0
    return FINGERPRINT.pack(context, 0, seq, COLLECTIVES.index(collective), code, dtype_code,
                            REDUCE_OPS.index(op), root, count)


def pack_p2p(context: int, tag: int, seq: int, dtype_code: int, count: int) -> bytes:
    """The fingerprint of point-to-point message ``seq`` of ``tag`` between a pair of ranks."""
    return FINGERPRINT.pack(context, tag, seq, 0, 0, dtype_code, 0, -1, count)


def disagreeing(tag: bytes, unconsumed: dict[int, list[bytes]]) -> tuple[int, bytes] | None:
    """The first of the ``unconsumed`` messages (tags by sender) that belongs to the same
    collective as ``tag`` (same context and sequence number) but carries another fingerprint:
    ``(sender, its tag)``, or None.

    Ranks that disagree on, say, the root of a broadcast may never receive from each other; the
    message one of them sent is still waiting, unconsumed, and tells what happened.
    """
    context, _, seq = FINGERPRINT.unpack_from(tag)[:3]
    for src, tags in unconsumed.items():
        for got in tags:
            got_context, _, got_seq, coll = FINGERPRINT.unpack_from(got)[:4]
            if got_context == context and got_seq == seq and coll and got[:len(tag)] != tag:
                return src, got
    return None


def earlier(tag: bytes, unread: dict[int, list[bytes]]) -> tuple[int, bytes] | None:
    """The first of the ``unread`` messages (tags by sender) of a collective of ``tag``'s context
    numbered before ``tag``'s, as ``(sender, its tag)``; None if none.

    Every rank receives all its messages of a collective in it, so such a message never will be:
    a call left it (ranks that disagreed on a root, each only sending, and returning).
    """
    context, _, seq = FINGERPRINT.unpack_from(tag)[:3]
    for src, tags in unread.items():
        for got in tags:
            got_context, p2p_tag, got_seq, coll = FINGERPRINT.unpack_from(got)[:4]
            if got_context == context and not p2p_tag and coll and got_seq < seq:
                return src, got
    return None


def describe(tag: bytes, numbered: bool = True) -> str:
    """``"allreduce #7 float32[1000] sum (ring)"`` for a message's tag (any bytes: a field out of
    range is shown as its number); ``numbered`` False leaves out the ``#7``."""
    if len(tag) < FINGERPRINT.size:
        return f"an unrecognised message ({len(tag)}-byte tag)"
    context, p2p_tag, seq, coll, algo, code, op, root, count = FINGERPRINT.unpack_from(tag)
    dtype = DTYPES_BY_CODE[code].name if code in DTYPES_BY_CODE else "meta"
    text = COLLECTIVES[coll] if coll < len(COLLECTIVES) else f"collective {coll}"
    text += f" #{seq} {dtype}[{count}]" if numbered else f" {dtype}[{count}]"
    if op:
        text += f" {REDUCE_OPS[op]}" if op < len(REDUCE_OPS) else f" op {op}"
    if root >= 0:
        text += f" root={root}"
    if p2p_tag:
        text += f" tag={p2p_tag}"
    text += f" ({_ALGORITHM_NAMES.get((coll, algo), f'algorithm {algo}')})" if algo else ""
    return text + (f" on sub-mesh {context:08x}" if context else "")


class Signature(NamedTuple):
    """What every rank must agree on for one collective: :meth:`lab.Mesh.collective`'s arguments
    (they make its fingerprint)."""

    collective: str
    algorithm: str
    dtype: DType
    count: int
    op: str = ""
    root: int = -1
    compiled: bool = True  # may take the compiled path (lab.compiled.plane) when small enough
