"""A fit with several training dataloaders (a ``CombinedLoader``, in each mode Lightning trains with)
stopped inside an epoch and resumed trains every following step on the samples of the uninterrupted
run and to its losses, at the same and at another world size ([Note: several training dataloaders]
in data.py); so does a dataloader with worker processes resumed into a later epoch (its workers took
their first indices before Lightning set the epoch); a fit the strategy cannot position says so."""

from __future__ import annotations

import warnings

import lightning_utilities.core.rank_zero
import pytest
import torch
import torch.distributed as dist
from dist_utils import LogLines, run_ranks
from lightning.pytorch.loops.progress import _BatchProgress as Progress
from lightning.pytorch.utilities import CombinedLoader
from test_resume_stops import GLOBAL_BATCH, SAMPLES, Indexed, _assert_continues, _result, _trainer
from test_strategy import LIGHTNING_ENV
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy.data import DataPosition, ResumableDistributedSampler
from fsdp_strategy.strategy_data import TrainingPositions

MODES = ("max_size_cycle", "max_size", "min_size")  # the modes Lightning trains with ("sequential" it refuses)
# stopped inside "a"'s first pass (it cycles after the resume), after "a" ran out, inside epoch 1 (min_size: 4
# batches per epoch); "b" alone (None) inside epoch 1
STOPS = {"max_size_cycle": 3, "max_size": 6, "min_size": 6, None: 11}


class TwoLoaders(Indexed):
    """Records the samples of both loaders ("b"'s ids offset by 1000) and trains on both."""

    def training_step(self, batch, batch_idx):
        parts = [part for part in (batch["a"], batch["b"]) if part is not None]  # max_size: "a" ran out
        return super().training_step((torch.cat([x for x, _ in parts]), torch.cat([i for _, i in parts])), batch_idx)


def _loader(world: int, samples: int, offset: int, workers: int) -> DataLoader:
    x = torch.randn(samples, 5, generator=torch.Generator().manual_seed(offset + 1), dtype=torch.float64)
    dataset = TensorDataset(x, torch.arange(samples) + offset)
    return DataLoader(dataset, batch_size=GLOBAL_BATCH // world, shuffle=True, num_workers=workers)


def _fit(world: int, root: str, mode: str | None, ckpt: str | None = None, workers: int = 0, **stop) -> dict:
    """``mode``: "a" (48 samples: 4 batches) and "b" (96: 8) combined so; None: "b" alone. The
    ``_result``, with what rank 0 logged and warned."""
    handler = LogLines()
    lightning_utilities.core.rank_zero.log.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = _loader(world, SAMPLES, 1000, workers)
        if mode is not None:
            data = CombinedLoader({"a": _loader(world, 48, 0, workers), "b": data}, mode)
        module, trainer = (TwoLoaders() if mode else Indexed()), _trainer(world, root, "full", **stop)
        trainer.fit(module, data, ckpt_path=ckpt)
    lightning_utilities.core.rank_zero.log.removeHandler(handler)
    return {**_result(module, trainer, world), "said": handler.lines + [str(w.message) for w in caught]}


def _loaders_body(rank: int, world: int, root: str, phase: str) -> dict:
    out = {}
    if phase == "save":
        for mode, stop in STOPS.items():
            out[mode, "uninterrupted"] = _fit(world, f"{root}/{mode}-whole", mode, max_steps=14)
            out[mode, "stopped"] = _fit(world, f"{root}/{mode}", mode, max_steps=stop)
        cut = _fit(world, f"{root}/cut", "max_size_cycle", max_steps=2, limit_train_batches=3)
        out["cut"] = cut["said"], sorted(torch.load(f"{root}/cut/last.ckpt", weights_only=False))
        # resumed inside "a"'s first pass, stopped again inside its second (begun after the resume)
        hop = f"{root}/max_size_cycle/last.ckpt"
        out["hop"] = _fit(world, f"{root}/hop", "max_size_cycle", hop, max_steps=6)
        # the same checkpoint in another mode: taken back (the epoch taken again from its first batch), said;
        # that fit's own checkpoint resumes as it goes on
        out["other mode"] = _fit(world, f"{root}/other-mode", "max_size", f"{root}/hop/last.ckpt", max_steps=8)
        hop, other = f"{root}/hop/last.ckpt", f"{root}/other-mode/last.ckpt"
        out["other mode, on"] = _fit(world, f"{root}/other-on", "max_size", hop, max_steps=12)
        out["other mode, resumed"] = _fit(world, f"{root}/other-resumed", "max_size", other, max_steps=12)
        # Lightning writes the processed loaders into the CombinedLoader it was given: a reload (as a second
        # fit or one after the LR finder) gets them back with the strategy's samplers
        # a checkpoint of a fit stopped inside epoch 1 as DDP writes it (no data position), resumed: the epoch
        # is taken again whole, and that fit's own checkpoint resumes as it goes on
        foreign = torch.load(f"{root}/None/last.ckpt", weights_only=False)
        del foreign["fsdp_custom_data_position"]
        if rank == 0:
            torch.save(foreign, f"{root}/foreign.ckpt")
        dist.barrier()
        foreign = f"{root}/foreign.ckpt"
        out["foreign", "on"] = _fit(world, f"{root}/foreign-on", None, foreign, max_steps=18)
        out["foreign", "stopped"] = _fit(world, f"{root}/foreign-stopped", None, foreign, max_steps=14)
        ckpt = f"{root}/foreign-stopped/last.ckpt"
        out["foreign", "resumed"] = _fit(world, f"{root}/foreign-resumed", None, ckpt, max_steps=18)
        reload = {"reload_dataloaders_every_n_epochs": 1}
        out["reload"] = _fit(world, f"{root}/reload-whole", "max_size_cycle", max_steps=14, **reload)
        out["reload, stopped"] = _fit(world, f"{root}/reload", "max_size_cycle", max_steps=11, **reload)
        ckpt = f"{root}/reload/last.ckpt"
        out["reload, resumed"] = _fit(world, f"{root}/reload-on", "max_size_cycle", ckpt, max_steps=14, **reload)
    workers = 1 if phase == "other" else 0  # [Note: ...] on another world size, with a worker process each
    for mode in MODES if phase == "save" else ("max_size_cycle", "max_size", None):
        ckpt = f"{root}/{'hop' if mode == 'max_size_cycle' else mode}/last.ckpt"
        out[mode, "resumed"] = _fit(world, f"{root}/{mode}-{world}", mode, ckpt, workers, max_steps=14)
    return out


def test_several_training_dataloaders_resume_sample_by_sample(tmp_path):
    saved = run_ranks(_loaders_body, 2, tmp_path, str(tmp_path), "save", env=LIGHTNING_ENV, timeout=300)[0]
    other = run_ranks(_loaders_body, 3, tmp_path, str(tmp_path), "other", env=LIGHTNING_ENV, timeout=300)[0]
    cycled = saved["max_size_cycle", "uninterrupted"]
    _assert_continues(saved["max_size_cycle", "stopped"], saved["hop"], cycled, "max_size_cycle resumed once")
    for mode, world, resumed in [(mode, 2, saved[mode, "resumed"]) for mode in MODES] + [
        (mode, 3, other[mode, "resumed"]) for mode in ("max_size_cycle", "max_size", None)
    ]:
        where = f"{mode or 'one loader with a worker'} resumed at world {world}"
        stopped = saved["hop"] if mode == "max_size_cycle" else saved[mode, "stopped"]
        _assert_continues(stopped, resumed, saved[mode, "uninterrupted"], where)
        said = " ".join(resumed["said"])
        assert "exactly where the checkpoint left it" in said and "your dataloader is not resumable" not in said, (
            where,
            said,
        )
        if mode:
            assert "samples of its 2 training dataloaders' current passes" in said, (where, said)
    said, keys = saved["cut"]
    assert "fsdp_custom_data_position" not in keys, keys
    assert any("several training dataloaders (a limit_train_batches that cuts one of them)" in s for s in said), said
    other_mode = saved["other mode"]
    assert other_mode["steps"][0][0] == cycled["steps"][0][0], "the epoch's first batch, as under DDP"
    said = " ".join(other_mode["said"])
    assert "its training dataloaders were combined with mode='max_size_cycle' and this fit's with 'max_size'" in said
    assert "the epoch is taken again from its first batch" in said, said
    assert "exactly" not in said and "your dataloader is not resumable" in said, said
    on, resumed = saved["other mode, on"], saved["other mode, resumed"]
    assert [ids for ids, _ in on["steps"]] == [ids for ids, _ in other_mode["steps"] + resumed["steps"]]
    assert "exactly where the checkpoint left it" in " ".join(resumed["said"]), resumed["said"]
    on, stopped, resumed = (saved["foreign", run] for run in ("on", "stopped", "resumed"))
    assert on["start"] == 11 and on["steps"][0][0] == saved[None, "uninterrupted"]["steps"][8][0], "epoch 1, whole"
    assert [ids for ids, _ in on["steps"]] == [ids for ids, _ in stopped["steps"] + resumed["steps"]]
    assert "it holds no data position: the epoch is taken again from its first batch" in " ".join(on["said"])
    stopped, resumed = saved["reload, stopped"], saved["reload, resumed"]
    _assert_continues(stopped, resumed, saved["reload"], "a reloaded CombinedLoader")


def test_a_resume_at_another_world_size_says_when_an_epoch_changes_length():
    """With ``drop_last`` (or the sampler's padding) an epoch's batches depend on the number of ranks
    even at the same global batch: 28 samples are 4 batches of 3 per rank at 2 ranks, 5 of 2 at 3."""
    dataset = TensorDataset(torch.arange(28))
    positions = TrainingPositions(Progress(), {"epoch": 0, "consumed_samples": 12, "world_size": 2, "batch_size": 3})
    sampler = ResumableDistributedSampler(dataset, num_replicas=3, rank=0)
    positions.add(DataPosition(sampler, 2, drop_last=True), DataLoader(dataset), epoch=0)
    said = positions.describe_change(3, "max_size_cycle")
    assert "the same global batch of 6 samples per step" in said, said
    assert "an epoch is 4 batches at 2 ranks and 5 here" in said, said
    positions.saved["world_size"], positions.saved["batch_size"] = 3, 2
    assert positions.describe_change(3, "max_size_cycle") is None


@pytest.mark.parametrize(
    ("drop_last", "dealt"),
    [
        (
            False,
            "as 28 at 2 ranks and as 30 at 3 (repeats samples to fill every rank), this epoch's remaining 16 as 18",
        ),
        (True, "as 28 at 2 ranks and as 27 at 3 (drops the rest (drop_last)), this epoch's remaining 16 as 15"),
    ],
)
def test_a_resume_at_another_world_size_says_when_the_sampler_deals_other_samples(drop_last, dealt):
    """DistributedSampler fills every rank up with repeats (or drops the rest): 28 samples at 3 ranks."""
    dataset = TensorDataset(torch.arange(28))
    positions = TrainingPositions(Progress(), {"epoch": 0, "consumed_samples": 12, "world_size": 2, "batch_size": 3})
    sampler = ResumableDistributedSampler(dataset, num_replicas=3, rank=0, drop_last=drop_last)
    positions.add(DataPosition(sampler, 2), DataLoader(dataset), epoch=0)
    said = positions.describe_change(3, "max_size_cycle")
    assert f"DistributedSampler deals an epoch of 28 samples {dealt}" in said, said


def test_taking_back_a_position_at_an_epochs_start_changes_nothing():
    """A checkpoint at an epoch's end, resumed by a fit it does not fit: nothing was skipped or counted."""
    dataset = TensorDataset(torch.arange(28))
    for consumed, changed in ((0, (False, False)), (12, (True, True))):
        progress = Progress()
        progress.current.processed = progress.current.completed = consumed // 6
        positions = TrainingPositions(progress, {"epoch": 0, "consumed_samples": consumed, "world_size": 2})
        positions.add(DataPosition(ResumableDistributedSampler(dataset, 2, 0), 3), DataLoader(dataset), epoch=0)
        assert positions.undo(restart_epoch=True) == changed, consumed
        assert progress.current.processed == 0
