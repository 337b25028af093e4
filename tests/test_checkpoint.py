"""Sharded and full checkpoints of the engine: resharding on load, torch's DCP tools,
consolidation (formats, options, bounded memory), and every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import excerpt, run_ranks
from models import Block, TiedLM, lm_loss, make_batches
from torch import nn

from fsdp_strategy.checkpoint import (
    CheckpointError,
    consolidate,
    full_optimizer_state_dict,
    full_state_dict,
    load_folder,
    load_full_checkpoint,
    save_folder,
)
from fsdp_strategy.engine import shard_model


def _trained(rank: int, world: int, dim: int = 10, steps: int = 2):
    torch.manual_seed(0)
    model = TiedLM(dim=dim)
    shard_model(model, auto_wrap_policy={Block, nn.Embedding})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for batch in make_batches(steps, 2 * world):
        lm_loss(model, batch[rank::world]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _fresh(seed: int = 1, dim: int = 10):
    torch.manual_seed(seed)
    model = TiedLM(dim=dim)
    shard_model(model, auto_wrap_policy={Block, nn.Embedding})
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _save_body(rank: int, world: int, folder: str) -> dict:
    model, optimizer = _trained(rank, world)
    save_folder(Path(folder), model, [optimizer], {"epoch": 3})
    return {"model": full_state_dict(model), "optim": full_optimizer_state_dict(model, optimizer)}


def _load_body(rank: int, world: int, folder: str) -> dict:
    model, optimizer = _fresh()
    rest = load_folder(Path(folder), model, [optimizer])
    return {"model": full_state_dict(model), "optim": full_optimizer_state_dict(model, optimizer), "rest": rest}


def _assert_same_state(loaded: dict, saved: dict) -> None:
    assert loaded["model"].keys() == saved["model"].keys()
    for name, tensor in saved["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert loaded["optim"]["state"].keys() == saved["optim"]["state"].keys()
    for fqn, entries in saved["optim"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(loaded["optim"]["state"][fqn][key], value), (fqn, key)
    assert loaded["optim"]["param_groups"] == saved["optim"]["param_groups"]


@pytest.fixture(scope="module")
def saved_world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    folder = root / "ckpt"
    saved = run_ranks(_save_body, 2, root, str(folder))[0]
    return folder, saved


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_checkpoint_loads_at_any_world_size(saved_world2, tmp_path, world):
    folder, saved = saved_world2
    loaded = run_ranks(_load_body, world, tmp_path, str(folder))[0]
    _assert_same_state(loaded, saved)
    assert loaded["rest"]["epoch"] == 3


def test_folder_is_an_ordinary_dcp_checkpoint(saved_world2, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, saved = saved_world2
    dcp_to_torch_save(str(folder), str(tmp_path / "plain.pt"))
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    for name, tensor in saved["model"].items():
        assert torch.equal(plain["model"][name], tensor), name
    meta = json.loads((folder / "fsdp_meta.json").read_text())
    assert meta["world_size"] == 2 and meta["format_version"] == 2
    assert meta["plan"]["params"]["blocks.0.up.weight"]["shape"] == [21, 10]


def test_consolidate_torch_format_loads_into_plain_module(saved_world2, tmp_path):
    folder, saved = saved_world2
    out = consolidate(folder, tmp_path / "full.pt")
    checkpoint = torch.load(out, weights_only=False)
    plain = TiedLM()
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    assert plain.head.weight is plain.embed.weight
    for name, tensor in saved["model"].items():
        assert torch.equal(plain.state_dict()[name], tensor), name
    assert checkpoint["epoch"] == 3
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # torch's layout: by position
    position = [id(p) for p in plain.parameters() if p.requires_grad].index(id(plain.blocks[0].up.weight))
    state = optimizer.state[plain.blocks[0].up.weight]
    assert torch.equal(state["exp_avg"], saved["optim"]["state"][position]["exp_avg"])
    assert optimizer.state_dict()["param_groups"] == saved["optim"]["param_groups"]


def test_consolidate_options_and_cli(saved_world2, tmp_path, capsys):
    folder, saved = saved_world2
    weights = torch.load(consolidate(folder, tmp_path / "w.pt", weights_only=True, dtype="bf16"))
    assert set(weights) == set(saved["model"])
    assert weights["blocks.0.up.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["blocks.0.up.weight"], saved["model"]["blocks.0.up.weight"].bfloat16())

    from safetensors.torch import load_file

    sharded_out = consolidate(folder, tmp_path / "st", output_format="safetensors", max_shard_size="2KB")
    index = json.loads((sharded_out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    merged = {k: v for name in files for k, v in load_file(str(sharded_out / name)).items()}
    assert all(torch.equal(merged[k], v) for k, v in saved["model"].items())

    cli = subprocess.run(
        ["fsdp-consolidate", str(folder), str(tmp_path / "cli.pt"), "--weights-only"], capture_output=True, text=True
    )
    assert cli.returncode == 0, cli.stderr
    assert torch.equal(torch.load(tmp_path / "cli.pt")["embed.weight"], saved["model"]["embed.weight"])
    capsys.readouterr()
    # the other cases through the command's main in this process (the installed command ran above)
    from fsdp_strategy.consolidate import main

    def cli_status(*args: str) -> str:
        return main([str(folder), *args])

    assert cli_status(str(tmp_path / "cli.pt")) == 2 and "exists" in capsys.readouterr().err  # no overwrite

    assert cli_status(str(tmp_path / "no" / "such" / "dir" / "x.pt")) == 2  # a missing output folder: a message
    assert cli_status(str(tmp_path / "st2"), "--format", "safetensors", "--max-shard-size", "2") == 2  # no unit
    assert "error: --max-shard-size='2' has no unit" in capsys.readouterr().err  # the command's flags
    assert cli_status(str(tmp_path / "cli.pt"), "--strip-prefix", "net.") == 2
    told = capsys.readouterr().err
    assert "--strip-prefix='net.' writes a plain module state dict: use it with --weights-only or --format=" in told
    assert cli_status(str(tmp_path / "cli.pt"), "--weights-only") == 2
    assert "exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert cli_status(str(tmp_path / "st2"), "--max-shard-size", "2GB") == 2
    assert "error: --max-shard-size needs --format=safetensors" in capsys.readouterr().err
    assert not (tmp_path / "st2").exists() and not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match="has no unit"):
        consolidate(folder, tmp_path / "st3", output_format="safetensors", max_shard_size="2")
    for size in ("0MB", "-1MB", "abcMB", 0):
        with pytest.raises(ValueError, match="must be positive|is not a size"):
            consolidate(folder, tmp_path / "st3", output_format="safetensors", max_shard_size=size)
    assert not (tmp_path / "st3").exists()
    for flag in ("--version", "--help"):
        with pytest.raises(SystemExit) as exited:
            main([flag])
        assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("fsdp-consolidate 0.")
    assert "``" not in printed and "--max-shard-size SIZE" in printed and "2GB" in printed


def test_overwrite_never_deletes_the_checkpoint_or_a_foreign_folder(saved_world2, tmp_path, capsys):
    from fsdp_strategy.consolidate import main

    folder, saved = saved_world2
    before = sorted(path.relative_to(folder) for path in folder.rglob("*"))
    with pytest.raises(ValueError, match="is the checkpoint .* or inside it"):
        consolidate(folder, folder, overwrite=True)
    with pytest.raises(ValueError, match="or inside it"):
        consolidate(folder, folder / "out.pt", overwrite=True)
    with pytest.raises(ValueError, match="holds the checkpoint .* would delete the checkpoint"):
        consolidate(folder, folder.parent, overwrite=True)
    assert main([str(folder), str(folder.parent), "--overwrite"]) == 2
    assert "holds the checkpoint" in capsys.readouterr().err
    assert sorted(path.relative_to(folder) for path in folder.rglob("*")) == before
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main([str(folder), str(foreign), "--overwrite"]) == 2
    assert "a folder this tool did not write" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine"
    shards = consolidate(folder, tmp_path / "st", output_format="safetensors", max_shard_size="2KB")
    (shards / "extra.bin").write_bytes(b"x")  # a file the user put there: the folder is no longer ours
    with pytest.raises(FileExistsError, match="did not write"):
        consolidate(folder, shards, output_format="safetensors", max_shard_size="4KB", overwrite=True)
    (shards / "extra.bin").unlink()
    replaced = consolidate(folder, shards, output_format="safetensors", max_shard_size="4KB", overwrite=True)
    index = json.loads((replaced / "model.safetensors.index.json").read_text())
    assert {path.name for path in replaced.iterdir()} == {*index["weight_map"].values(), "model.safetensors.index.json"}
    (tmp_path / "w.pt").write_bytes(b"old")
    weights = torch.load(consolidate(folder, tmp_path / "w.pt", weights_only=True, overwrite=True))
    assert torch.equal(weights["embed.weight"], saved["model"]["embed.weight"])


def _peak(src, dst, **options) -> int:
    """Peak memory growth (bytes) of one consolidation, in a fresh process (tests/peak_memory.py)."""
    script = Path(__file__).with_name("peak_memory.py")
    done = subprocess.run(
        [sys.executable, str(script), str(src), str(dst), json.dumps(options)], capture_output=True, text=True
    )
    assert done.returncode == 0, excerpt(done.stderr, 3000)
    return int(done.stdout.strip().splitlines()[-1])


def _big_save_body(rank: int, world: int, folder: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])  # 16 x 1 MiB weights
    shard_model(model, auto_wrap_policy={nn.Linear})
    save_folder(Path(folder), model, [], {})
    return sum(p.numel() * p.element_size() for p in model.state_dict().values()) * world


def test_consolidation_memory_is_bounded_by_output_plus_largest_tensor(tmp_path):
    folder = tmp_path / "big"
    run_ranks(_big_save_body, 2, tmp_path, str(folder))
    output = sum(p.numel() * 4 for p in nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)]).parameters())
    largest = 512 * 512 * 4
    peak = _peak(folder, tmp_path / "big.pt", weights_only=True)
    assert peak < output + largest, (peak, output, largest)
    streamed = _peak(folder, tmp_path / "big_st", output_format="safetensors", max_shard_size=2 * largest)
    # safetensors serializes a shard to bytes before writing it: two shards (of two tensors) + one tensor
    assert streamed < 2 * (2 * largest) + largest, (streamed, largest)


def _bad_input_body(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    model, optimizer = _trained(rank, world)
    save_folder(root / "good", model, [optimizer], {})
    later, later_optimizer = _trained(rank, world, steps=3)
    save_folder(root / "later", later, [later_optimizer], {})  # another run: its shards mixed in below
    torch.distributed.barrier()
    messages = {}

    def attempt(name, load) -> None:
        fresh, fresh_optimizer = _fresh()
        before = full_state_dict(fresh, rank0_only=False)
        try:
            load(fresh, fresh_optimizer)
            messages[name] = "no error"
        except (CheckpointError, FileNotFoundError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
        after = full_state_dict(fresh, rank0_only=False)
        messages[name + ":unchanged"] = all(torch.equal(before[k], after[k]) for k in before)

    def damaged(kind: str) -> Path:
        folder = root / kind
        if rank == 0:
            __import__("shutil").copytree(root / "good", folder)
            shard = folder / "__1_0.distcp"
            if kind == "truncated":
                shard.write_bytes(shard.read_bytes()[:-100])
            elif kind == "corrupted":
                data = bytearray(shard.read_bytes())
                data[len(data) // 2] ^= 0xFF
                shard.write_bytes(bytes(data))
            elif kind == "missing":
                shard.unlink()
            elif kind == "mixed":
                __import__("shutil").copy(root / "later" / "__1_0.distcp", shard)
            elif kind == "version":
                meta = json.loads((folder / "fsdp_meta.json").read_text())
                meta["format_version"] = 99
                (folder / "fsdp_meta.json").write_text(json.dumps(meta))
        torch.distributed.barrier()
        return folder

    for kind in ("truncated", "corrupted", "missing", "mixed", "version"):
        folder = damaged(kind)
        attempt(kind, lambda m, o, folder=folder: load_folder(folder, m, [o]))
    attempt("nonexistent", lambda m, o: load_folder(root / "nope", m, [o]))

    torch.manual_seed(0)
    other = TiedLM(dim=12)
    shard_model(other, auto_wrap_policy={Block})
    save_folder(root / "other", other, [], {})
    attempt("other_model", lambda m, o: load_folder(root / "other", m, [o]))

    full_file = root / "full.ckpt"
    state = full_state_dict(model)
    if rank == 0:
        torch.save({"state_dict": state}, full_file)
        (root / "cut.ckpt").write_bytes(full_file.read_bytes()[:200])
        smaller = {k: v for k, v in state.items() if k != "scale"}
        torch.save({"state_dict": smaller}, root / "missing_key.ckpt")
        torch.save({"state_dict": {**state, "extra.weight": torch.zeros(2)}}, root / "extra_key.ckpt")
    torch.distributed.barrier()
    attempt("full_as_sharded", lambda m, o: load_folder(full_file, m, [o]))
    attempt("sharded_as_full", lambda m, o: load_full_checkpoint(root / "good", m, [o]))
    other_optimizer = lambda m: [torch.optim.SGD([p for p in m.parameters() if p.requires_grad][:3], lr=0.1)]  # noqa: E731
    attempt("other_optimizer_sharded", lambda m, o: load_folder(root / "good", m, other_optimizer(m)))
    if rank == 0:
        torch.save(
            {"state_dict": state, "optimizer_states": [full_optimizer_state_dict(model, optimizer)]}, root / "o.pt"
        )
    else:
        full_optimizer_state_dict(model, optimizer)
    torch.distributed.barrier()
    attempt("other_optimizer_full", lambda m, o: load_full_checkpoint(root / "o.pt", m, other_optimizer(m)))
    attempt("full_truncated", lambda m, o: load_full_checkpoint(root / "cut.ckpt", m, [o]))
    attempt("full_missing_key", lambda m, o: load_full_checkpoint(root / "missing_key.ckpt", m, [o]))
    attempt("full_unexpected_key", lambda m, o: load_full_checkpoint(root / "extra_key.ckpt", m, [o]))
    torch.manual_seed(0)
    larger = TiedLM()
    larger.extra = nn.Linear(2, 2)
    shard_model(larger, auto_wrap_policy={Block})
    save_folder(root / "larger", larger, [], {})
    attempt("sharded_unexpected_key", lambda m, o: load_folder(root / "larger", m, [o]))
    good, good_optimizer = _fresh()
    load_folder(root / "good", good, [good_optimizer])  # the good checkpoint still loads after all that
    messages["good_loads"] = torch.equal(
        full_state_dict(good, rank0_only=False)["embed.weight"],
        state.get("embed.weight", full_state_dict(good, rank0_only=False)["embed.weight"]),
    )
    return messages


def test_bad_checkpoints_fail_clearly_on_every_rank(tmp_path):
    results = run_ranks(_bad_input_body, 2, tmp_path, str(tmp_path), timeout=180)
    expected = {
        "truncated": r"__1_0\.distcp: corrupted or truncated",
        "corrupted": r"__1_0\.distcp: corrupted or truncated",
        "missing": r"__1_0\.distcp: missing",
        "mixed": r"__1_0\.distcp: corrupted or truncated",  # a shard of another run: its CRC32 differs
        "sharded_as_full": r"good' is a folder \(a sharded checkpoint, or none\), but a full checkpoint file",
        "other_optimizer_sharded": r"good: checkpoint of another model\? It has optimizer state for \d+ "
        r"parameters this optimizer does not hold",
        "other_optimizer_full": r"o\.pt: optimizer param group 0 holds \d+ parameters in the checkpoint, 3 in",
        "version": r"fsdp_meta\.json: key 'format_version' is 99",
        "nonexistent": r"FileNotFoundError: checkpoint .*nope' does not exist",
        # torch's own load_state_dict message (full shapes), as a RuntimeError naming the file
        "other_model": r"(?s)StrictLoadError: .*\.metadata: .*size mismatch for blocks\.0\.down\.bias: copying a "
        r"param with shape torch\.Size\(\[12\]\) from checkpoint, the shape in current model is torch\.Size\(\[10\]\)",
        "full_as_sharded": r"full\.ckpt' is a file, but a sharded checkpoint",
        "full_truncated": r"cut\.ckpt: not a readable checkpoint file",
        "full_missing_key": r"missing_key\.ckpt: checkpoint of another model\? 1 of the model's \d+ keys are missing "
        r"from it and it holds 0 the model does not have; nothing was loaded: keys missing from it \['scale'\]",
        "full_unexpected_key": r"extra_key\.ckpt: checkpoint of another model\? .*unexpected keys \['extra\.weight'\]",
        "sharded_unexpected_key": r"larger.*checkpoint of another model\? .*unexpected keys \['extra\.bias', 'extra",
    }
    import re

    for messages in results:  # every rank raises, none hangs
        for name, pattern in expected.items():
            assert re.search(pattern, messages[name]), (name, messages[name])
            assert messages[name + ":unchanged"], name
        assert messages["good_loads"]


def _full_save_memory_body(rank: int, world: int) -> dict:
    import ctypes

    from peak_memory import status

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: freed big blocks leave RSS at once
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])  # 16 units of 1 MiB + bias
    shard_model(model, auto_wrap_policy={nn.Linear})
    full_state_dict(model)  # warm-up: lazy initialization outside the measurement
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    base = status("VmRSS")
    state = full_state_dict(model)
    return {"peak": status("VmHWM") - base, "output": sum(t.numel() * t.element_size() for t in state.values())}


def test_full_state_dict_memory_is_output_plus_about_one_unit(tmp_path):
    rank0, rank1 = run_ranks(_full_save_memory_body, 2, tmp_path)
    unit = (512 * 512 + 512) * 4
    assert rank0["output"] == 16 * unit
    # the CPU output, plus the unit being gathered: its flat shard, the gather buffer (and the
    # transport's), the copies out of it: a small multiple of one unit, never of the model
    assert rank0["peak"] < rank0["output"] + 3 * unit, (rank0, unit)
    assert rank1["output"] == 0 and rank1["peak"] < 3 * unit, (rank1, unit)


def _hsdp_save_body(rank: int, world: int, folder: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = TiedLM()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_model(model, sharding_strategy="HYBRID_SHARD", device_mesh=mesh, auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    lm_loss(model, make_batches(1, 2 * world)[0][rank::world]).backward()
    optimizer.step()
    save_folder(Path(folder), model, [optimizer], {})
    return {"model": full_state_dict(model), "optim": full_optimizer_state_dict(model, optimizer)}


def test_hybrid_shard_checkpoint_loads_as_full_shard(tmp_path):
    saved = run_ranks(_hsdp_save_body, 4, tmp_path, str(tmp_path / "hsdp"))[0]
    loaded = run_ranks(_load_body, 2, tmp_path, str(tmp_path / "hsdp"))[0]
    _assert_same_state(loaded, saved)


def _async_body(rank: int, world: int, root: str) -> dict:
    from fsdp_strategy.checkpoint.writer import CheckpointWriter

    model, optimizer = _trained(rank, world)
    before = full_state_dict(model, rank0_only=False)
    writer = CheckpointWriter(async_save=True)
    writer.setup()
    writer.save_sharded(Path(root) / "async", Path(root) / ".async.tmp", model, [optimizer], {"step": 1})
    in_flight = writer._thread is not None
    with torch.no_grad():  # training goes on and changes the shards while the save is written
        for param in model.parameters():
            param.add_(1.0)
    writer.teardown()
    fresh, fresh_optimizer = _fresh()
    load_folder(Path(root) / "async", fresh, [fresh_optimizer])
    after = full_state_dict(fresh, rank0_only=False)
    return {"in_flight": in_flight, "equal": all(torch.equal(before[k], after[k]) for k in before)}


def test_async_save_returns_at_once_and_keeps_the_values_of_its_step(tmp_path):
    for result in run_ranks(_async_body, 2, tmp_path, str(tmp_path)):
        assert result["in_flight"] and result["equal"]


class _WithNorm(nn.Module):
    """TiedLM and BatchNorm statistics after it, under one attribute (as in a LightningModule)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _inner()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net.norm(self.net.lm(tokens).transpose(1, 2)).transpose(1, 2)


def _inner() -> nn.ModuleDict:
    return nn.ModuleDict({"lm": TiedLM(), "norm": nn.BatchNorm1d(37)})


def _with_norm(seed: int) -> nn.Module:
    from fsdp_strategy import MixedPrecision

    torch.manual_seed(seed)
    model = _WithNorm()
    shard_model(
        model, auto_wrap_policy={Block}, mixed_precision=MixedPrecision(param_dtype="bf16", buffer_dtype="bf16")
    )
    return model


def _buffer_dtype_body(rank: int, world: int, folder: str) -> dict:
    model = _with_norm(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in make_batches(2, 2 * world):
        lm_loss(model, batch[rank::world]).backward()
        optimizer.step()
        optimizer.zero_grad()
    live = model.net.norm.running_mean.clone()
    full = full_state_dict(model, rank0_only=False)
    save_folder(Path(folder), model, [], {})
    fresh = _with_norm(1)
    load_folder(Path(folder), fresh, [])
    return {"live": live, "full": full["net.norm.running_mean"], "reloaded": fresh.net.norm.running_mean}


def test_buffers_keep_their_dtype_in_checkpoints_and_prefix_strips(tmp_path):
    folder = tmp_path / "norm"
    result = run_ranks(_buffer_dtype_body, 2, tmp_path, str(folder))[0]
    assert result["live"].dtype == torch.bfloat16  # trained in buffer_dtype, as asked
    assert result["full"].dtype == torch.float32 and torch.equal(result["full"], result["live"].float())
    meta = json.loads((folder / "fsdp_meta.json").read_text())
    assert meta["plan"]["buffers"]["net.norm.running_mean"]["dtype"] == "float32"
    assert result["reloaded"].dtype == torch.bfloat16 and torch.equal(result["reloaded"], result["live"])

    inner = _inner()
    inner.load_state_dict(torch.load(consolidate(folder, tmp_path / "n.pt", weights_only=True, strip_prefix="net")))
    assert inner.norm.running_mean.dtype == torch.float32
    assert torch.equal(inner.norm.running_mean, result["full"])
    with pytest.raises(ValueError, match=r"the keys \['net.norm.bias', .*\] do not start with it"):
        consolidate(folder, tmp_path / "x.pt", weights_only=True, strip_prefix="net.lm")
    with pytest.raises(ValueError, match="use it with weights_only=True"):
        consolidate(folder, tmp_path / "x.pt", strip_prefix="net.")
    from fsdp_strategy.consolidate import main

    assert main([str(folder), str(tmp_path / "cli.pt"), "--weights-only", "--strip-prefix", "net."]) == 0
    _inner().load_state_dict(torch.load(tmp_path / "cli.pt"), strict=True)


def _missing_shard_body(rank: int, world: int, folder: str) -> str:
    import os

    import torch.distributed as dist

    model, optimizer = _trained(rank, world)
    save_folder(Path(folder), model, [optimizer], {"epoch": 1})
    dist.barrier()
    if rank == 0:  # a folder in Lightning FSDP's layout (no fsdp_meta.json, so no CRC32s) missing a shard
        os.remove(f"{folder}/fsdp_meta.json")
        os.remove(f"{folder}/__1_0.distcp")
    dist.barrier()
    fresh, fresh_optimizer = _fresh()
    with pytest.raises(CheckpointError) as caught:
        load_folder(Path(folder), fresh, [fresh_optimizer])
    return str(caught.value)


def test_a_missing_shard_of_a_folder_without_checksums_is_named_on_every_rank(tmp_path):
    for message in run_ranks(_missing_shard_body, 2, tmp_path, str(tmp_path / "ckpt")):
        assert "__1_0.distcp is missing" in message and "nothing was loaded" in message, message
