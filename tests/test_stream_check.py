"""The stream check (``FSDP_CUSTOM_STREAM_CHECK=1``, on in every test: conftest.py) models CUDA's
host/device semantics on the CPU. Training with offloaded shards passes it and matches one device;
removing either wait the device layer makes ends in ``StreamCheckError`` naming the wait."""

from __future__ import annotations

import copy

import torch
from dist_utils import run_ranks
from models import Block, TiedLM, lm_loss, make_batches

from fsdp_strategy.engine import get_scheduler, shard_model
from fsdp_strategy.engine.device import DeviceLayer, StreamCheck, StreamCheckError


def _steps(rank: int, world: int, offload: bool, closure: bool = False) -> float:
    """Two offloaded training steps against one device; the largest loss difference. With
    ``closure`` the step runs forward and backward inside ``optimizer.step`` (Lightning's way)."""
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    shard_model(model, auto_wrap_policy={Block}, cpu_offload=offload)
    assert isinstance(get_scheduler(model).device_layer, StreamCheck)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    worst = 0.0
    try:
        for batch in make_batches(2, 2 * world):

            def forward_backward(batch=batch) -> torch.Tensor:
                loss = lm_loss(model, batch[rank::world])
                loss.backward()
                return loss

            loss = optimizer.step(forward_backward) if closure else forward_backward()
            if not closure:
                optimizer.step()
            optimizer.zero_grad()
            ref_loss = lm_loss(reference, batch)
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            worst = max(worst, abs(mean.item() / world - ref_loss.item()))
    finally:
        get_scheduler(model).close()
    return worst


def _without(wait: str, rank: int, world: int, closure: bool = False) -> str:
    """The same training with one of the layer's waits removed: the check's message."""
    original = getattr(DeviceLayer, wait)
    setattr(DeviceLayer, wait, lambda self: None)
    try:
        _steps(rank, world, offload=True, closure=closure)
    except StreamCheckError as error:
        return str(error)
    finally:
        setattr(DeviceLayer, wait, original)
    return "no error"


def _stream_check_body(rank: int, world: int) -> dict:
    return {
        "offloaded": _steps(rank, world, offload=True),
        "on_device": _steps(rank, world, offload=False),
        "closure": _steps(rank, world, offload=True, closure=True),
        "no_shard_wait": _without("before_host_writes_shards", rank, world),
        "no_shard_wait_closure": _without("before_host_writes_shards", rank, world, closure=True),
        "no_grad_wait": _without("before_host_reads_grads", rank, world),
    }


def test_stream_check_passes_training_and_fails_without_each_wait(tmp_path):
    for result in run_ranks(_stream_check_body, 2, tmp_path):
        assert max(result["offloaded"], result["on_device"], result["closure"]) < 1e-5, result
        for told in (result["no_shard_wait"], result["no_shard_wait_closure"]):
            assert "an optimizer step writes a tensor" in told, told
            assert "copy of unit" in told and "before_host_writes_shards()" in told, told
        assert "an optimizer step reads a tensor" in result["no_grad_wait"], result["no_grad_wait"]
        assert (
            "gradient to host memory" in result["no_grad_wait"]
            and "before_host_reads_grads()" in result["no_grad_wait"]
        )


def test_stream_check_is_the_layer_only_when_asked(monkeypatch):
    from fsdp_strategy.engine.device import device_layer

    cpu = torch.device("cpu")
    monkeypatch.setenv("FSDP_CUSTOM_STREAM_CHECK", "0")
    assert type(device_layer(cpu, cpu, offloaded=True)) is DeviceLayer
    monkeypatch.setenv("FSDP_CUSTOM_STREAM_CHECK", "1")
    assert isinstance(device_layer(cpu, cpu, offloaded=True), StreamCheck)


def _hook_runs_the_model_body(rank: int, world: int) -> str:
    """A Lightning fit with offloaded shards whose ``on_before_optimizer_step`` runs the model
    (after the closure's backward, before the update): the update must wait for its copies."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from test_strategy import LitLM, quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from fsdp_strategy import FSDPCustomStrategy, summon_full_params

    class EvaluatesBeforeStep(LitLM):
        def on_before_optimizer_step(self, optimizer):
            with torch.no_grad(), summon_full_params(self):  # gathers: copies of the offloaded shards
                self.net(self.trainer.train_dataloader.dataset.tensors[0][:2, :-1])

    torch.manual_seed(0)
    rank_zero_only.rank = rank
    trainer = quiet_trainer(
        strategy=FSDPCustomStrategy(auto_wrap_policy={Block}, cpu_offload=True), devices=world, max_steps=2
    )
    try:
        trainer.fit(EvaluatesBeforeStep(), DataLoader(TensorDataset(make_batches(8, 1).reshape(8, -1)), batch_size=2))
    except StreamCheckError as error:
        return str(error)
    return "no error"


def test_an_update_after_a_hook_that_runs_the_model_waits_for_its_copies(tmp_path):
    from test_strategy import LIGHTNING_ENV

    results = run_ranks(_hook_runs_the_model_body, 2, tmp_path, env=LIGHTNING_ENV, timeout=300)
    assert results == ["no error", "no error"], results
