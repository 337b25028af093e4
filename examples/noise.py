"""Silence messages of the libraries that are known to be harmless for these examples, and only
those: a deprecation inside Lightning that torch 2.13 reports on every run, Lightning's tips
advertising another logger and another checkpoint callback, W&B's warning about the ``anonymous`` setting Lightning's
``WandbLogger`` always passes (None: no effect), and, on a resume, Lightning's warning that the
checkpoint directory is not empty (it holds the checkpoint resumed from). Every other warning
still shows."""

from __future__ import annotations

import logging
import warnings
from typing import Any


class _DropLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "try installing [lit" not in record.getMessage()  # litlogger's and litmodels' tips


def quiet_known_noise() -> None:
    """Install the filters (idempotent; cheap)."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(existing, _DropLoggerTip) for existing in tips.filters):
        tips.addFilter(_DropLoggerTip())


def quiet_resume_noise() -> None:
    """On a resume: the checkpoint directory holds the checkpoint resumed from, as it should."""
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def without_unused_wandb_settings(logger: Any) -> Any:
    """``logger`` (Lightning's ``WandbLogger``, before its run starts) without ``anonymous=None``, which
    Lightning passes to ``wandb.init`` and wandb 0.31 warns has no effect."""
    init = getattr(logger, "_wandb_init", {})
    if init.get("anonymous", "set") is None:
        del init["anonymous"]
    return logger
