"""How tensors of any dtype travel in one flat buffer: complex ones as their real pairs, a mix of
dtypes as bytes.

[Note: flat buffers of any dtype]
A unit gathers all its shards in one buffer and reduces all its gradients in one buffer. Every
tensor goes in as its *real view*: a float tensor as itself, a complex one as its interleaved
real and imaginary parts (``view(dtype.to_real())``: twice the elements). Where every tensor's
real dtype is the same, the buffer has that dtype (the common case: no cost). Where they differ
(a complex64 parameter beside bfloat16 ones under ``param_dtype=bf16``, or a float64 parameter
beside float32 ones) the buffer is bytes (``uint8``), each tensor's columns padded to 8 bytes so
that every piece can be viewed in its own dtype, as FSDP2 gathers mixed dtypes. A collective
never carries a complex tensor, so every backend moves them; nothing is cast but what the caller
casts on purpose (``param_dtype``), so a complex value keeps its imaginary part.
Costs: none for one dtype; with several, at most 7 bytes of padding per tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ALIGNMENT = 8  # bytes: the largest element a piece is viewed as (float64)


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype a tensor of ``dtype`` travels as (complex64 -> float32; others unchanged)."""
    return dtype.to_real() if dtype.is_complex else dtype


def real_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` flattened, complex ones as their real pairs (a view: no copy)."""
    flat = tensor.reshape(-1)
    return flat.view(real_dtype(flat.dtype)) if flat.is_complex() else flat


def complex_from_real(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A real tensor of pairs (its last dimension) as ``dtype`` (complex): the inverse of ``real_view``
    (copies where the pairs are not aligned for a view: an odd offset or row stride)."""
    flat = flat.to(real_dtype(dtype))
    if flat.storage_offset() % 2 or not flat.is_contiguous() or any(stride % 2 for stride in flat.stride()[:-1]):
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(dtype)


class FlatLayout(NamedTuple):
    """Where each tensor goes in a flat buffer ([Note: flat buffers of any dtype])."""

    dtype: torch.dtype  # the buffer's: the tensors' common real dtype, or uint8 when they differ
    sizes: list[int]  # each tensor's columns, in elements of ``dtype`` (padding included)
    reals: list[torch.dtype]  # each tensor's real dtype
    numels: list[int]  # each tensor's elements in its real dtype

    @classmethod
    def of(cls, dtypes: list[torch.dtype], numels: list[int]) -> FlatLayout:
        """The layout of tensors of ``dtypes`` with ``numels`` elements each (complex counted once)."""
        reals = [real_dtype(d) for d in dtypes]
        real_numels = [n * (2 if d.is_complex else 1) for d, n in zip(dtypes, numels)]
        if len(set(reals)) <= 1:
            return cls(reals[0] if reals else torch.float32, real_numels, reals, real_numels)
        sizes = [-(-n * d.itemsize // ALIGNMENT) * ALIGNMENT for d, n in zip(reals, real_numels)]
        return cls(torch.uint8, sizes, reals, real_numels)

    @property
    def total(self) -> int:
        """Elements of ``dtype`` the tensors take in all."""
        return sum(self.sizes)

    @property
    def bytes_mode(self) -> bool:
        """Whether the buffer carries bytes (the tensors' dtypes differ)."""
        return self.dtype == torch.uint8 and any(real != torch.uint8 for real in self.reals)

    def pieces(self, columns: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's part of ``columns`` (the last dimension holds the tensors, in order), viewed
        in the tensor's real dtype."""
        parts = columns.split(self.sizes, dim=-1)
        if not self.bytes_mode:
            return list(parts)
        return [part[..., : n * real.itemsize].view(real) for part, real, n in zip(parts, self.reals, self.numels)]
