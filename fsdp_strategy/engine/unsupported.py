"""Modules the engine refuses by name when a model is sharded, before anything is allocated.

[Note: modules refused at sharding]
- An embedding with ``max_norm`` (``nn.Embedding``, ``nn.EmbeddingBag``) renormalizes the rows
  it looks up in place, inside its forward. Each rank looks up the rows of its own batch, so each
  rank changes different rows of the full weight, while the write-back of changes made while
  gathered keeps each rank's own rows ([Note: edits while gathered]): rows one rank owns and only
  another renormalized would keep their old values, silently (under DDP the replicas drift apart
  instead). Refused where the weight is sharded over more than one rank.
- A sparse embedding (``sparse=True``) gives a sparse gradient, which no reduce-scatter carries.
Costs: one pass over the modules at sharding.
"""

from __future__ import annotations

from torch import nn


def refuse_unsupported_modules(module: nn.Module, skipped: frozenset[int], shard_size: int) -> None:
    """Raise for the first module of ``module`` (those in ``skipped``, ignored modules, excepted) that
    the engine cannot train exactly ([Note: modules refused at sharding])."""
    for name, sub in module.named_modules():
        if id(sub) in skipped or not isinstance(sub, (nn.Embedding, nn.EmbeddingBag)):
            continue
        kind = f"{name or 'the model'} ({type(sub).__name__})"
        if sub.sparse:
            raise ValueError(
                f"fsdp_custom: {kind} has sparse=True: its sparse gradient cannot be reduce-scattered into "
                "shards. Use sparse=False (the default)"
            )
        if sub.max_norm is not None and shard_size > 1:
            raise ValueError(
                f"fsdp_custom: {kind} has max_norm={sub.max_norm}: it renormalizes the rows each rank looks up in "
                "place during forward, and a sharded weight keeps each rank's own rows only, so rows renormalized "
                "on another rank would be lost. Use max_norm=None and renormalize the weight's rows explicitly "
                "between steps (e.g. in a callback's on_train_batch_end: each row lies whole in one rank's shard)"
            )
