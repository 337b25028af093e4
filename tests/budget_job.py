"""A Lightning job whose settings ``auto_wrap_policy="auto"`` chooses within a budget (run by test_plan.py).

    python tests/budget_job.py BUDGET_BYTES

Two CPU ranks under Lightning's own launcher (the plan runs before the process group exists);
rank 0 prints the chosen settings and the measured peak of live tensor bytes of the last step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "benchmarks")]
from plan_accuracy import MODELS, PeakOfLastStep  # noqa: E402

from fsdp_strategy import FSDPCustomStrategy  # noqa: E402
from fsdp_strategy.plan.run import STEPS  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    module, batch, _ = MODELS["gpt"]()
    strategy = FSDPCustomStrategy(
        auto_wrap_policy="auto", memory_budget=int(sys.argv[1]), memory_reserve=0, example_batch=batch
    )
    peak = PeakOfLastStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[peak], use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader([batch] * STEPS, batch_size=None))
    if trainer.global_rank == 0:
        chosen = {
            "sharding_strategy": strategy.sharding_strategy.value,
            "offload": strategy.cpu_offload.offload_params,
            "per_block": strategy.auto_wrap_policy is not None,
            "checkpointed": sorted(strategy.activation_checkpointing_policy or []),
            "units": len(strategy.scheduler.units),
            "measured": peak.peak,
        }
        print("CHOSEN " + json.dumps(chosen), flush=True)


if __name__ == "__main__":
    main()
