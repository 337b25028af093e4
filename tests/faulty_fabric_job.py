"""A Fabric loop with one fault injected on one rank, for tests/test_fabric.py.

    python tests/faulty_fabric_job.py --fault kill --rank 1 --step 3            # fabric.launch() spawns 2 ranks
    torchrun --nproc_per_node=2 tests/faulty_fabric_job.py --fault kill ...     # torchrun
    fabric run --accelerator=cpu --devices=2 tests/faulty_fabric_job.py         # Fabric's CLI (no fault)

Faults, at ``--step`` on ``--rank``: ``kill`` (SIGKILL of itself), ``raise`` (ValueError in the
loop); ``none`` trains 6 steps and prints FINISHED on rank 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).parent))
from models import Block, TiedLM, lm_loss, make_batches  # noqa: E402

from fsdp_strategy import FSDPCustomFabricStrategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="none", choices=["none", "kill", "raise"])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=3)
    args = parser.parse_args()
    launched_by_cli = "LT_DEVICES" in os.environ  # fabric run: devices and accelerator come from its flags
    hardware = {} if launched_by_cli else {"accelerator": "cpu", "devices": 2}
    fabric = Fabric(strategy=FSDPCustomFabricStrategy(auto_wrap_policy={Block}, collective_timeout=60), **hardware)
    if not launched_by_cli:  # under fabric run the processes exist and Fabric sets itself up
        fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TiedLM())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step, batch in enumerate(make_batches(6, 2 * fabric.world_size)):
        if fabric.global_rank == args.rank and step == args.step:
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "raise":
                raise ValueError("injected failure in the loop")
        loss = lm_loss(model, batch[fabric.global_rank :: fabric.world_size])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.print(f"FINISHED on {fabric.world_size} ranks")


if __name__ == "__main__":
    main()
