"""Point-to-point's wire format: :meth:`lab.Mesh.send` sends a fixed-size header, uncounted, then
the tensor's payload; :meth:`lab.Mesh.recv` reads the header to know what to receive.

The header is ``HEADER_WORDS`` int64 words: is it a torch tensor, its dtype code, its number of
dimensions, its shape (up to ``MAX_DIMS``).

    header = encode_header(torch.zeros(2, 3), DTYPES["float32"])   # [1, code, 2, 2, 3, 0, ...]
    incoming = decode_header(header)        # incoming.flat: 6 float32 to receive into
    incoming.tensor()                       # a torch tensor of shape (2, 3) over them
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from lab.buffers import to_caller_type
from lab.ops import DTYPES_BY_CODE, DType

#: The most dimensions a tensor sent point-to-point may have.
MAX_DIMS = 16
HEADER_WORDS = 3 + MAX_DIMS  # is_torch, dtype code, ndim, shape


def encode_header(tensor: Any, dtype: DType) -> np.ndarray:
    """The header of ``tensor`` (torch or numpy) of ``dtype``; ``ValueError`` past ``MAX_DIMS``."""
    shape = tuple(np.shape(tensor))
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensor has {len(shape)} dimensions; send supports up to {MAX_DIMS}")
    header = np.zeros(HEADER_WORDS, np.int64)
    header[:3] = isinstance(tensor, torch.Tensor), dtype.code, len(shape)
    header[3:3 + len(shape)] = shape
    return header


class Incoming(NamedTuple):
    """A tensor announced by a header: ``flat``, the buffer its payload is received into."""

    flat: np.ndarray
    dtype: DType
    shape: tuple[int, ...]
    is_torch: bool

    def tensor(self) -> Any:
        """The received tensor, of the sender's kind, dtype and shape."""
        like = torch.empty(0, dtype=self.dtype.torch_dtype) if self.is_torch else np.empty(0, self.dtype.name)
        return to_caller_type(self.flat, self.dtype, self.shape, like)


def decode_header(header: np.ndarray) -> Incoming:
    """The tensor ``header`` announces, with an empty buffer for its payload."""
    is_torch, code, ndim = (int(v) for v in header[:3])
    shape = tuple(int(v) for v in header[3:3 + ndim])
    dtype = DTYPES_BY_CODE[code]
    return Incoming(np.empty(int(np.prod(shape)), dtype.storage), dtype, shape, bool(is_torch))
