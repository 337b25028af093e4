"""Whether a DCP folder's stored chunks tile each of its tensors exactly once.

DCP records, per tensor, the chunks the ranks wrote (offsets and sizes) and nothing of the placements
that made them; a load reads, for each requested region, whatever chunks overlap it. A folder whose
chunks leave part of a tensor out, overlap, or reach past it (a layout this version cannot read, a
writer that computed wrong offsets: uneven strided shards in some torch versions, pytorch#168134, a
rank's shards missing from the metadata) would load zeros or the wrong rows without a word. Every
read of a folder checks its metadata first, so such a folder is a ``CheckpointError`` naming the
tensor before anything is loaded.
"""

from __future__ import annotations

import math
from typing import Any


def untiled(metadata: Any) -> dict[str, str]:
    """``{stored key: what is wrong}`` for the tensors of a DCP ``metadata`` whose chunks do not tile
    them exactly once. Costs: a sweep over each tensor's chunks (about chunks x ranks per band
    compared), no tensor data read."""
    found = {}
    for key, info in metadata.state_dict_metadata.items():
        chunks = getattr(info, "chunks", None)
        if chunks is None:  # an object (param groups, extra state), not a tensor
            continue
        problem = tiling_problem(tuple(info.size), [(tuple(c.offsets), tuple(c.sizes)) for c in chunks])
        if problem is not None:
            found[key] = problem
    return found


def tiling_problem(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Why ``chunks`` (``(offsets, sizes)``) do not cover a tensor of ``size`` exactly once; None if they do."""
    volume = 0
    for offsets, sizes in chunks:
        inside = len(offsets) == len(sizes) == len(size)
        if not inside or any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, size)):
            return f"a chunk at offsets {list(offsets)} of size {list(sizes)} lies outside its shape {list(size)}"
        volume += math.prod(sizes)
    boxes = sorted((offsets, sizes) for offsets, sizes in chunks if math.prod(sizes))
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in boxes:  # a sweep along the first dimension: only boxes whose rows meet are compared
        active = [other for other in active if other[0][0] + other[1][0] > box[0][0]] if size else active
        for other in active:
            if all(a < c + d and c < a + b for a, b, c, d in zip(box[0], box[1], other[0], other[1])):
                return f"its chunks at offsets {list(other[0])} and {list(box[0])} overlap"
        active.append(box)
    if volume != math.prod(size):
        return f"its chunks hold {volume} of its {math.prod(size)} elements"
    return None
