"""Callbacks that report what the FSDP engine does (shipped as ``fsdp_strategy.callbacks``)."""
