"""A Fabric loop resumed from ``fabric.save(path, {..., "loader": loader})`` continues with the samples
and losses of the uninterrupted loop: mid-epoch and after an epoch's last batch, sharded and full, at
the same and at another world size ([Note: a Fabric loop's data position] in data.py)."""

from __future__ import annotations

import warnings

import lightning_utilities.core.rank_zero
import torch
from dist_utils import LogLines, run_ranks
from lightning.fabric import Fabric
from test_strategy import LIGHTNING_ENV
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomFabricStrategy

SAMPLES, PER_RANK, EPOCHS = 48, 4, 2  # 48 samples: whole global batches over 2 and 3 ranks


def _features() -> torch.Tensor:
    return torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _loop(world: int, state_dict_type: str = "sharded", sampler: bool = True, workers: int = 0, persistent=False):
    fabric = Fabric(
        strategy=FSDPCustomFabricStrategy(state_dict_type=state_dict_type), accelerator="cpu", devices=world
    )
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    data = TensorDataset(torch.arange(SAMPLES), _features())
    loader = DataLoader(data, batch_size=PER_RANK, shuffle=True, num_workers=workers, persistent_workers=persistent)
    if not sampler:  # a sampler of the user's own: Fabric leaves it alone
        generator = torch.Generator().manual_seed(fabric.global_rank)
        loader = DataLoader(
            data, batch_size=PER_RANK, sampler=torch.utils.data.RandomSampler(data, generator=generator)
        )
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=sampler)
    return fabric, model, optimizer, loader


def _train(fabric, model, optimizer, loader, start_epoch, stop_after=None, save=None, how="inside", loop=None):
    """Steps from ``start_epoch``: per step the global batch's sample ids (sorted) and the loss. After
    ``stop_after`` steps, ``save(epoch)`` and stop: ``how`` "inside" the ``for``, after a "break" out of
    it, or once the epoch's ``for`` has run to its "end". ``loop``: "own_epoch" (the loop calls the
    sampler's ``set_epoch`` itself, as plain PyTorch loops do), "zip_with" (a second loader zipped with
    the first), "peek_at" (after that step, ``next(iter(loader))``: a look at a batch)."""
    loop = loop or {}
    steps = []
    for epoch in range(start_epoch, EPOCHS):
        if loop.get("own_epoch"):
            loader.sampler.set_epoch(epoch)
        other = loop.get("zip_with")
        batches = loader if other is None else (mine for mine, _ in zip(loader, other))
        for ids, x in batches:
            loss = model(x).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            every = fabric.all_gather(ids).flatten().sort().values.tolist()
            steps.append((every, fabric.all_reduce(loss.detach(), reduce_op="mean").item()))
            if len(steps) == loop.get("peek_at"):
                next(iter(loader))
            if len(steps) == stop_after and how == "inside":
                save(epoch)
                return steps
            if len(steps) == stop_after and how == "break":
                break
        if len(steps) == stop_after:
            save(epoch if how == "break" else epoch + 1)  # a loop saving per epoch counts the next one
            return steps
    return steps


CASES = {  # name: (steps before the save, how it saves, state_dict_type, _loop's keywords, the loop's habits)
    "mid": (3, "inside", "sharded", {"workers": 2}, {}),  # workers prefetch ahead of the loop
    "end": (6, "inside", "full", {}, {}),  # at epoch 0's last batch, inside its `for`
    "after": (6, "end", "sharded", {}, {}),
    "persist": (8, "inside", "sharded", {"workers": 2, "persistent": True}, {"own_epoch": True}),  # workers reused
    "nested": (3, "inside", "sharded", {}, {}),  # the loader inside a dict of the state
    "break": (2, "break", "sharded", {}, {}),
    "zip": (6, "end", "sharded", {}, {"zip_with": True}),  # two loaders: the second is never asked past its end
    "peek": (3, "inside", "sharded", {}, {"peek_at": 1}),  # a look at a batch inside the `for`
    "peek_save": (3, "inside", "sharded", {}, {"peek_at": 3}),  # ... right before the save
}


def _habits(loop: dict, fabric) -> tuple[dict, dict]:
    """The loop's habits with a second loader made for "zip_with", and what the state holds of it."""
    if not loop.get("zip_with"):
        return loop, {}
    other = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(SAMPLES), _features()), PER_RANK, True))
    return {**loop, "zip_with": other}, {"other": other}


def _state(name: str, model, optimizer, loader) -> dict:
    if name == "nested":
        return {"model": model, "optimizer": optimizer, "data": {"train": loader, "note": "kept"}}
    return {"model": model, "optimizer": optimizer, "loader": loader}


def _save_body(rank: int, world: int, folder: str) -> dict:
    fabric, model, optimizer, loader = _loop(world)
    results = {"whole": _train(fabric, model, optimizer, loader, 0)}
    for name in ("peek", "peek_save"):  # the uninterrupted loops with the same look
        fabric, model, optimizer, loader = _loop(world)
        results[f"whole_{name}"] = _train(fabric, model, optimizer, loader, 0, loop=CASES[name][4])
    for name, (stop, how, kind, options, habits) in CASES.items():
        fabric, model, optimizer, loader = _loop(world, kind, **options)
        loop, more = _habits(habits, fabric)
        state = {**_state(name, model, optimizer, loader), **more}

        def save(epoch: int, name: str = name, fabric: Fabric = fabric, state: dict = state) -> None:
            fabric.save(f"{folder}/{name}", {**state, "epoch": epoch})

        results[name] = _train(fabric, model, optimizer, loader, 0, stop, save, how, loop)
    return results


def _loaded(fabric: Fabric, path: str, state: dict) -> list[str]:
    """``fabric.load(path, state)``; what it told (Lightning's info lines and our warnings)."""
    handler = LogLines()
    rank_zero_log = lightning_utilities.core.rank_zero.log  # the logger Lightning's rank_zero_info writes to
    rank_zero_log.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, state)
    rank_zero_log.removeHandler(handler)
    return handler.lines + [str(w.message) for w in caught if "fsdp_custom" in str(w.message)]


def _resume_body(rank: int, world: int, folder: str, names: list[str]) -> dict:
    results = {}
    for name in names:
        chain = name.endswith("+1")  # one step, then saved again as "chain"
        name = name.removesuffix("+1")
        _, _, kind, options, habits = CASES.get(name, CASES["mid"])
        fabric, model, optimizer, loader = _loop(world, kind, **options)
        loop, more = _habits(habits, fabric)
        loop = {key: value for key, value in loop.items() if key != "peek_at"}  # the look came before the save
        if name == "rollback":  # a loop that goes back to an earlier checkpoint in the middle of its own epoch
            _train(fabric, model, optimizer, loader, 0, 4, lambda epoch: None, "break")
            state = {**_state("mid", model, optimizer, loader), "epoch": 0}
            told = _loaded(fabric, f"{folder}/mid", state)
            fabric.save(f"{folder}/rollback", state)  # before any iter(): the position just loaded
        else:
            state = {**_state(name, model, optimizer, loader), **more, "epoch": 0}
            told = _loaded(fabric, f"{folder}/{name.removeprefix('saved-')}", state)
        assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
        if name == "nested":  # Fabric's load puts the inner DataLoader in the dict: the loop iterates that
            assert state["data"]["note"] == "kept", state
            loader = state["data"]["train"]
        else:
            assert state["loader"] is loader  # resumed in place, not replaced by what was saved
        if chain:

            def save(epoch: int, fabric: Fabric = fabric, state: dict = state) -> None:
                fabric.save(f"{folder}/chain", {**state, "epoch": epoch})

            results["chain"] = _train(fabric, model, optimizer, loader, state["epoch"], 1, save)
            continue
        steps = _train(fabric, model, optimizer, loader, state["epoch"], loop=loop)
        results[name] = {"steps": steps, "told": told}
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
    for name, (stop, *_) in CASES.items():
        assert saved[name] == whole[:stop], name
    names = [*CASES, "rollback"]
    same = run_ranks(_resume_body, 2, tmp_path, folder, names, env=LIGHTNING_ENV, timeout=300)[0]
    assert saved["peek"] == saved["whole_peek"][:3] and saved["peek_save"] == saved["whole_peek_save"][:3]
    done = {name: stop for name, (stop, *_) in CASES.items()} | {"rollback": 3}
    for name, taken in done.items():
        steps, uninterrupted = same[name]["steps"], saved[f"whole_{name}" if name.startswith("peek") else "whole"]
        assert [ids for ids, _ in steps] == [ids for ids, _ in uninterrupted[taken:]], name  # the same samples
        for (_, loss), (_, expected) in zip(steps, uninterrupted[taken:], strict=True):
            assert abs(loss - expected) <= 1e-9 * abs(expected), (name, loss, expected)
    assert saved["whole_peek"][6:] != whole[6:]  # the look took an epoch of Fabric's count: the resume keeps it
    nested = " ".join(same["nested"]["told"])
    assert "puts the inner DataLoader back in place of the loader at 'data.train'" in nested, nested
    exact = "resumes epoch 0 at its next iter(), after its first 24 samples, exactly"
    assert any(exact in line for line in same["mid"]["told"]), same["mid"]["told"]
    assert any(exact in line for line in same["nested"]["told"]), same["nested"]["told"]
    assert any("'data.train' resumes" in line for line in same["nested"]["told"]), same["nested"]["told"]
    # saved after epoch 0's last batch inside its `for` (the user's epoch says 0): the resumed `for` ends at once
    assert any("resumes epoch 0 at its next iter(), after its first 48 samples" in line for line in same["end"]["told"])
    assert any("resumes epoch 1 at its next iter(), from its start" in line for line in same["after"]["told"])
    assert any(
        "resumes epoch 1 at its next iter(), after its first 16 samples" in line for line in same["persist"]["told"]
    )
    left = [line for line in same["break"]["told"] if "had left that epoch before its end" in line]
    assert left and "exactly" not in " ".join(same["break"]["told"]) and "would have started epoch 1" in left[0]
    # at 3 ranks: the rest of epoch 0 exactly once, then epoch 1 in 12-sample global batches
    names = ["mid", "mid+1", "saved-rollback"]
    resumed = run_ranks(_resume_body, 3, tmp_path, folder, names, env=LIGHTNING_ENV, timeout=300)[0]
    other = resumed["mid"]
    seen = [ids for ids, _ in other["steps"]]
    taken = {i for ids, _ in whole[:3] for i in ids}
    rest = sorted(i for ids in seen[:2] for i in ids)
    assert rest == sorted(set(range(SAMPLES)) - taken), rest
    assert seen[2:] == [sorted(_order(1)[k : k + 12]) for k in range(0, SAMPLES, 12)]
    assert any("trained on 2 ranks x 4 samples = 8 per step" in line for line in other["told"]), other["told"]
    assert resumed["saved-rollback"]["steps"] == other["steps"]  # saved right after a rollback: where it went back
    # a chain of resumes: saved at 3 ranks one step after the resume, resumed at 2: the rest of epoch 0 once
    assert resumed["chain"] == other["steps"][:1]
    back = run_ranks(_resume_body, 2, tmp_path, folder, ["chain"], env=LIGHTNING_ENV, timeout=300)[0]["chain"]
    taken |= set(other["steps"][0][0])
    rest = sorted(i for ids, _ in back["steps"][:2] for i in ids)
    assert rest == sorted(set(range(SAMPLES)) - taken), rest  # 36 taken: one 2-rank batch of 8, then the 4 left
    assert any("resumes epoch 0 at its next iter(), after its first 36 samples" in line for line in back["told"])


def test_a_dataloader_the_strategy_cannot_position_is_said_to_restart_its_epoch(tmp_path):
    told = run_ranks(_unpositioned_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    assert any("its position is not saved, and a resumed loop iterates it from the start" in line for line in told)
    assert any("starts from the start of an epoch as a new one" in line for line in told), told


def _half_step_body(rank: int, world: int, folder: str) -> dict:
    """A loop accumulating 2 batches per optimizer step saves after its third batch's backward (the
    step not yet taken), and after its fourth's step; each is resumed."""
    fabric, model, optimizer, loader = _loop(world)
    told = {}
    for taken, (_, x) in enumerate(loader, start=1):
        fabric.backward(model(x).pow(2).mean())
        if taken % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()
        if taken in (3, 4):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fabric.save(f"{folder}/after-{taken}", {"model": model, "optimizer": optimizer, "loader": loader})
            told[f"saved {taken}"] = [str(w.message) for w in caught if "fsdp_custom" in str(w.message)]
        if taken == 4:
            break
    for taken in (3, 4):
        fabric, model, optimizer, loader = _loop(world)
        state = {"model": model, "optimizer": optimizer, "loader": loader}
        told[f"resumed {taken}"] = _loaded(fabric, f"{folder}/after-{taken}", state)
    return told


def test_a_save_inside_an_accumulated_step_says_the_resume_is_not_exact(tmp_path):
    """[Note: a step half accumulated] in data.py, as a Fabric loop meets it: the checkpoint lacks the
    gradients of the step's backwards so far, and the save and the resume say so instead of "exactly"."""
    told = run_ranks(_half_step_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    lacking = "are not in the checkpoint, and the resumed loop goes on with the next batch"
    assert any(lacking in line for line in told["saved 3"]), told["saved 3"]
    assert not any(lacking in line for line in told["saved 4"]), told["saved 4"]  # right after the step
    resumed = " ".join(told["resumed 3"])
    assert "saved inside an accumulated optimizer step" in resumed and "exactly" not in resumed, resumed
    assert "after its first 32 samples, exactly where the checkpoint left it" in " ".join(told["resumed 4"])
