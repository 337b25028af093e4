"""Silence messages of the libraries that are known to be harmless for these examples, and only
those: a deprecation inside Lightning that torch 2.13 reports on every run, and Lightning's tip
advertising another logger. Every other warning still shows."""

from __future__ import annotations

import logging
import warnings


class _DropLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "try installing [litlogger]" not in record.getMessage()


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
