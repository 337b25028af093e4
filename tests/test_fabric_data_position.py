"""A Fabric loop resumed from ``fabric.save(path, {..., "loader": loader})`` continues with the samples
and losses of the uninterrupted loop: mid-epoch and after an epoch's last batch, sharded and full, at
the same and at another world size ([Note: a Fabric loop's data position] in data.py)."""

from __future__ import annotations

import logging
import warnings

import lightning_utilities.core.rank_zero
import torch
from dist_utils import run_ranks
from lightning.fabric import Fabric
from test_strategy import LIGHTNING_ENV
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomFabricStrategy

SAMPLES, PER_RANK, EPOCHS = 48, 4, 2  # 48 samples: whole global batches over 2 and 3 ranks


def _features() -> torch.Tensor:
    return torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _loop(world: int, state_dict_type: str = "sharded", sampler: bool = True, workers: int = 0):
    fabric = Fabric(
        strategy=FSDPCustomFabricStrategy(state_dict_type=state_dict_type), accelerator="cpu", devices=world
    )
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    data = TensorDataset(torch.arange(SAMPLES), _features())
    loader = DataLoader(data, batch_size=PER_RANK, shuffle=True, num_workers=workers)
    if not sampler:  # a sampler of the user's own: Fabric leaves it alone
        generator = torch.Generator().manual_seed(fabric.global_rank)
        loader = DataLoader(
            data, batch_size=PER_RANK, sampler=torch.utils.data.RandomSampler(data, generator=generator)
        )
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=sampler)
    return fabric, model, optimizer, loader


def _train(fabric, model, optimizer, loader, start_epoch: int, stop_after=None, save=None, after=False) -> list:
    """Steps from ``start_epoch``: per step the global batch's sample ids (sorted) and the loss;
    ``save(epoch)`` after ``stop_after`` steps (``after``: once the epoch's ``for`` ended), then stop."""
    steps = []
    for epoch in range(start_epoch, EPOCHS):
        for ids, x in loader:
            loss = model(x).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            every = fabric.all_gather(ids).flatten().sort().values.tolist()
            steps.append((every, fabric.all_reduce(loss.detach(), reduce_op="mean").item()))
            if stop_after is not None and len(steps) == stop_after and save is not None and not after:
                save(epoch)
                return steps
        if stop_after is not None and len(steps) == stop_after and save is not None:
            save(epoch + 1)  # after the epoch's last batch, as a loop saving per epoch does
            return steps
    return steps


def _save_body(rank: int, world: int, folder: str) -> dict:
    fabric, model, optimizer, loader = _loop(world)
    whole = _train(fabric, model, optimizer, loader, 0)
    results = {"whole": whole}
    for name, stop, kind in (("mid", 3, "sharded"), ("end", 6, "full"), ("after", 6, "sharded")):
        fabric, model, optimizer, loader = _loop(world, kind, workers=2 if name == "mid" else 0)  # workers prefetch

        state = {"model": model, "optimizer": optimizer, "loader": loader}

        def save(epoch: int, name: str = name, fabric: Fabric = fabric, state: dict = state) -> None:
            fabric.save(f"{folder}/{name}", {**state, "epoch": epoch})

        results[name] = _train(fabric, model, optimizer, loader, 0, stop, save, after=name == "after")
    return results


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _resume_body(rank: int, world: int, folder: str, names: list[str]) -> dict:
    results = {}
    for name in names:
        chain = name.endswith("+1")  # one step, then saved again as "chain"
        name = name.removesuffix("+1")
        fabric, model, optimizer, loader = _loop(world, "full" if name == "end" else "sharded")
        state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0}
        handler = _Records()
        rank_zero_log = lightning_utilities.core.rank_zero.log  # the logger Lightning's rank_zero_info writes to
        rank_zero_log.addHandler(handler)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fabric.load(f"{folder}/{name}", state)
        rank_zero_log.removeHandler(handler)
        told = handler.lines + [str(w.message) for w in caught if "fsdp_custom" in str(w.message)]
        assert state["loader"] is loader  # resumed in place, not replaced by what was saved
        assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
        if chain:

            def save(epoch: int, fabric: Fabric = fabric, state: dict = state) -> None:
                fabric.save(f"{folder}/chain", {**state, "epoch": epoch})

            results["chain"] = _train(fabric, model, optimizer, loader, state["epoch"], 1, save)
            continue
        results[name] = {"steps": _train(fabric, model, optimizer, loader, state["epoch"]), "told": told}
    return results


def _unpositioned_body(rank: int, world: int, folder: str) -> list[str]:
    fabric, model, optimizer, loader = _loop(world, sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(
            fabric,
            model,
            optimizer,
            loader,
            0,
            2,
            lambda epoch: fabric.save(f"{folder}/own", {"loader": loader, "model": model}),
        )
        fabric, model, optimizer, loader = _loop(world, sampler=False)
        fabric.load(f"{folder}/own", {"loader": loader, "model": model})
    return [str(w.message) for w in caught if "fsdp_custom" in str(w.message)]


def _order(epoch: int) -> list[int]:
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()


def test_a_fabric_loop_resumes_its_dataloader_where_the_checkpoint_left_it(tmp_path):
    folder = str(tmp_path)
    saved = run_ranks(_save_body, 2, tmp_path, folder, env=LIGHTNING_ENV, timeout=300)[0]
    whole = saved["whole"]
    assert len(whole) == EPOCHS * SAMPLES // (2 * PER_RANK)
    assert saved["mid"] == whole[:3] and saved["end"] == saved["after"] == whole[:6]
    names = ["mid", "end", "after"]
    same = run_ranks(_resume_body, 2, tmp_path, folder, names, env=LIGHTNING_ENV, timeout=300)[0]
    for name, done in (("mid", 3), ("end", 6), ("after", 6)):
        steps = same[name]["steps"]
        assert [ids for ids, _ in steps] == [ids for ids, _ in whole[done:]], name  # the same samples, step by step
        for (_, loss), (_, expected) in zip(steps, whole[done:]):
            assert abs(loss - expected) <= 1e-9 * abs(expected), (name, loss, expected)
    assert any("resumes epoch 0 after its first 24 samples, exactly" in line for line in same["mid"]["told"])
    # saved after epoch 0's last batch inside its `for` (the user's epoch says 0): the resumed `for` ends at once
    assert any("resumes epoch 0 after its first 48 samples" in line for line in same["end"]["told"]), same["end"]
    assert any("resumes epoch 1 at its start" in line for line in same["after"]["told"]), same["after"]["told"]
    # at 3 ranks: the rest of epoch 0 exactly once, then epoch 1 in 12-sample global batches
    resumed = run_ranks(_resume_body, 3, tmp_path, folder, ["mid", "mid+1"], env=LIGHTNING_ENV, timeout=300)[0]
    other = resumed["mid"]
    seen = [ids for ids, _ in other["steps"]]
    taken = {i for ids, _ in whole[:3] for i in ids}
    rest = sorted(i for ids in seen[:2] for i in ids)
    assert rest == sorted(set(range(SAMPLES)) - taken), rest
    assert seen[2:] == [sorted(_order(1)[k : k + 12]) for k in range(0, SAMPLES, 12)]
    assert any("trained on 2 ranks x 4 samples = 8 per step" in line for line in other["told"]), other["told"]
    # a chain of resumes: saved at 3 ranks one step after the resume, resumed at 2: the rest of epoch 0 once
    assert resumed["chain"] == other["steps"][:1]
    back = run_ranks(_resume_body, 2, tmp_path, folder, ["chain"], env=LIGHTNING_ENV, timeout=300)[0]["chain"]
    taken |= set(other["steps"][0][0])
    rest = sorted(i for ids, _ in back["steps"][:2] for i in ids)
    assert rest == sorted(set(range(SAMPLES)) - taken), rest  # 36 taken: one 2-rank batch of 8, then the 4 left
    assert any("resumes epoch 0 after its first 36 samples" in line for line in back["told"]), back["told"]


def test_a_dataloader_the_strategy_cannot_position_is_said_to_restart_its_epoch(tmp_path):
    told = run_ranks(_unpositioned_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    assert any("its position is not saved, and a resumed loop iterates it from the start" in line for line in told)
    assert any("starts from the start of an epoch as a new one" in line for line in told), told
