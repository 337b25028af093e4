"""Every test runs its engines under the stream check (fsdp_strategy/engine/device.py): the copies
between offloaded shards and the compute device are treated as in flight until their wait, as on
CUDA, and a host access before it fails the test."""

import os

os.environ.setdefault("FSDP_CUSTOM_STREAM_CHECK", "1")
