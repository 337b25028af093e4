"""Callbacks that report what sharded training does (shipped as ``fsdp_strategy.callbacks``).

``MemoryMonitor`` (memory per rank), ``ThroughputMonitor`` (samples, tokens, FLOPs per second)
and ``CommunicationMonitor`` (the engine's collectives) log through the Trainer's loggers,
W&B's ``WandbLogger`` or any other.
"""

from fsdp_strategy.callbacks.communication import CommunicationMonitor
from fsdp_strategy.callbacks.memory import MemoryMonitor
from fsdp_strategy.callbacks.throughput import ThroughputMonitor

__all__ = ["CommunicationMonitor", "MemoryMonitor", "ThroughputMonitor"]
