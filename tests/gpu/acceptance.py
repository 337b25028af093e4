"""The GPU acceptance suite: every CUDA/NCCL path of the engine and the strategy on one GPU.

    python tests/gpu/acceptance.py            # one CUDA device, NCCL at world 1; prints a table
    python tests/gpu/acceptance.py --cpu      # the same script on the CPU with gloo (its own check)

Each check runs against an oracle (the unsharded model, the same run under Lightning's DDP, or
the exact formula) and its row says what was compared. At world 1 a shard is the whole parameter
and is used in place, so the checks that must gather, reduce and copy use CPU offload or mixed
precision; then the multi-rank checks run on spawned ranks: NCCL with one GPU per rank where there
are two or more GPUs, else two ranks over gloo on the one GPU (CUDA tensors). With CUDA present a
check that is not implemented is a failure, not a skip. Exit status 1 if any check fails.
``tests/gpu/test_cuda.py`` runs it under pytest (skipped without a GPU).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from dist_utils import free_port  # noqa: E402
from models import Block, TiedLM, lm_loss, make_batches  # noqa: E402
from oracle import assert_matches, train_pair  # noqa: E402
from test_host_reads import AdamWOfOurs  # noqa: E402
from test_patterns import PATTERNS  # noqa: E402

from fsdp_strategy import MixedPrecision  # noqa: E402
from fsdp_strategy.checkpoint import full_state_dict, load_folder, save_folder  # noqa: E402
from fsdp_strategy.engine import get_scheduler, shard_model  # noqa: E402

DEVICE = torch.device("cpu")


class TorchCannot(Exception):
    """A check torch itself cannot run in this setting (a skip, with the upstream issue, on any device)."""


def _needs_cuda() -> None:
    if DEVICE.type != "cuda":
        raise NotImplementedError("needs CUDA")


def patterns(**options) -> str:
    """Every training pattern of tests/test_patterns.py against its oracle."""
    for name, (build, policy, loss, data, before_step, steps) in PATTERNS.items():
        result = train_pair(
            dist.get_rank(),
            dist.get_world_size(),
            build,
            loss,
            data,
            steps=steps,
            before_step=before_step,
            auto_wrap_policy=policy,
            device=DEVICE,
            **options,
        )
        assert_matches(result, name)
    return f"{len(PATTERNS)} patterns equal their oracle"


def engine_parity(**options) -> str:
    """5 steps of TiedLM with clipping and AdamW against the unsharded model."""
    torch.manual_seed(0)
    model = TiedLM().to(DEVICE)
    reference = copy.deepcopy(model)
    shard_model(model, auto_wrap_policy={Block}, device=DEVICE, **options)
    scheduler = get_scheduler(model)
    if options.get("cpu_offload") and DEVICE.type == "cuda":
        assert all(p.sharded.device.type == "cpu" and p.sharded.is_pinned() for p in scheduler.sharded_params())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    worst = 0.0
    for batch in make_batches(5, 4).to(DEVICE):
        loss = lm_loss(model, batch)
        loss.backward()
        scheduler.clip_grad_norm_(0.5)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = lm_loss(reference, batch)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 0.5)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / ref_loss.item())
    scheduler.close()
    limit = 3e-2 if options.get("mixed_precision") else 1e-5
    assert worst < limit, f"loss differs from the unsharded model's by {worst:.2e} (limit {limit})"
    return f"loss within {worst:.1e} of the unsharded model's"


def cpu_built_model() -> str:
    """A model built on the CPU, ``sync_module_states=True``, no ``device``: NCCL gets device
    tensors only, everything lands on the current device, a shared buffer stays shared."""
    torch.manual_seed(0)
    model = TiedLM()
    shared = torch.arange(4.0)
    model.blocks[0].register_buffer("shared", shared)
    model.blocks[1].register_buffer("shared", shared)
    reference = copy.deepcopy(model).to(DEVICE)
    shard_model(model, auto_wrap_policy={Block}, sync_module_states=True, cpu_offload=True)
    scheduler = get_scheduler(model)
    assert all(b.device.type == DEVICE.type for b in model.buffers()), "a buffer was left off the device"
    assert model.blocks[0].shared is model.blocks[1].shared, "a shared buffer was split"
    batch = make_batches(1, 4)[0].to(DEVICE)
    difference = abs(lm_loss(model, batch).item() - lm_loss(reference, batch).item())
    scheduler.close()
    assert difference < 1e-5, f"loss differs by {difference:.2e}"
    return "placed on the device, buffers shared, loss equal"


def checkpoints_hsdp_offload() -> str:
    """A sharded folder saved from a 1x1 HSDP mesh with CPU offload loads into a fresh model
    (shards and optimizer state), and the full state dict matches."""
    from torch.distributed.device_mesh import init_device_mesh

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = TiedLM()
        mesh = init_device_mesh(DEVICE.type, (1, 1), mesh_dim_names=("replicate", "shard"))
        shard_model(
            model, sharding_strategy="HYBRID_SHARD", device_mesh=mesh, auto_wrap_policy={Block}, cpu_offload=True
        )
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = build(0)
    lm_loss(model, make_batches(1, 4)[0].to(DEVICE)).backward()
    optimizer.step()
    with tempfile.TemporaryDirectory() as folder:
        save_folder(Path(folder) / "ckpt", model, [optimizer], {})
        fresh, fresh_optimizer = build(1)
        load_folder(Path(folder) / "ckpt", fresh, [fresh_optimizer])
    saved, loaded = full_state_dict(model), full_state_dict(fresh)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved), "the loaded weights differ"
    steps = [state["step"] for state in fresh_optimizer.state.values()]
    assert steps and all(float(step) == 1.0 for step in steps), "the optimizer state was not loaded"
    for m in (model, fresh):
        get_scheduler(m).close()
    return "weights and optimizer state round-trip"


def lightning(precision: str) -> str:
    """``Trainer(strategy="fsdp_custom", precision=...)`` against the same run under Lightning's DDP
    (the same data order: both put a DistributedSampler in)."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from torch.utils.data import DataLoader

    import fsdp_strategy  # noqa: F401  (registers "fsdp_custom")

    if precision == "16-mixed":
        _needs_cuda()

    class FixedData(BoringModel):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(64, 32, generator=torch.Generator().manual_seed(1)), batch_size=2)

    def fit(strategy: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = FixedData()
        trainer = L.Trainer(
            strategy=strategy,
            accelerator=DEVICE.type,
            devices=1,
            precision=precision,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        return torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()])

    ours, theirs = fit("fsdp_custom"), fit("ddp")
    error = (ours - theirs).abs().max().item()
    assert error < 1e-2, f"weights differ from Lightning's DDP run by {error:.2e}"
    return f"weights within {error:.1e} of Lightning's DDP run"


def compiled_blocks() -> str:
    """``torch.compile`` per block, against the eager unsharded model."""
    torch.manual_seed(0)
    model = TiedLM().to(DEVICE)
    reference = copy.deepcopy(model)
    for block in model.blocks:
        block.compile()
    shard_model(model, auto_wrap_policy={Block}, device=DEVICE, cpu_offload=True)
    batch = make_batches(1, 4)[0].to(DEVICE)
    loss, ref_loss = lm_loss(model, batch), lm_loss(reference, batch)
    loss.backward()
    ref_loss.backward()
    get_scheduler(model).close()
    assert abs(loss.item() - ref_loss.item()) < 1e-4, (loss.item(), ref_loss.item())
    return "loss equal to eager"


def memory_account() -> str:
    """The growth of ``torch.cuda.max_memory_allocated`` over a step, from what is allocated before
    it (shards, gradients, optimizer state, cuBLAS workspaces), against the engine's account of
    gathered and reduce buffers at their peak: the account is never above the growth, and the
    growth is at most the account plus two units' full gradients (autograd's, in ``param_dtype``,
    before their reduce-scatter) and 4 MiB of activations."""
    _needs_cuda()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]).to(DEVICE)
    shard_model(model, auto_wrap_policy={nn.Linear}, device=DEVICE, mixed_precision=MixedPrecision(torch.bfloat16))
    scheduler = get_scheduler(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 2048, device=DEVICE)
    for _ in range(2):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    scheduler.memory.reset_peak()
    before = torch.cuda.memory_allocated()
    model(x).sum().backward()
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before
    account = scheduler.memory.peak
    unit_grads = max(unit.unsharded_nbytes for unit in scheduler.units)
    scheduler.close()
    told = f"growth {growth / 2**20:.1f} MiB, account {account / 2**20:.1f} MiB"
    assert 0.95 * account <= growth <= account + 2 * unit_grads + 4 * 2**20, told
    return told


def no_host_sync_in_a_step() -> str:
    """Steps after the first under ``torch.cuda.set_sync_debug_mode("error")``: no call of the
    engine waits for the device (the count tests/test_host_reads.py makes on the CPU), in fp32 and
    bf16 (its lost-edit flags go to the host without blocking), FULL_SHARD, SHARD_GRAD_OP and
    NO_SHARD, with ``clip_grad_norm_``, and with an optimizer not of torch (measured at its first
    step, its settings followed after each; at world 1 there are no ranks to compare its param groups
    with: tests/test_host_reads.py counts that comparison's host work at world 2). CPU offload is
    left out: its end of backward waits for the gradients' copies to host memory by design. TiedLM's
    parameters no rank uses (a block never called, a layer in each block) keep the one documented
    read: their usage flags at the end of backward (``Reductions.settle``), and nowhere else."""
    _needs_cuda()
    bf16 = {"mixed_precision": MixedPrecision(*[torch.bfloat16] * 3)}
    configs = {
        "fp32": ({}, None),
        "bf16": (bf16, None),
        "bf16 + SHARD_GRAD_OP": ({**bf16, "sharding_strategy": "SHARD_GRAD_OP"}, None),
        "bf16 + NO_SHARD": ({**bf16, "sharding_strategy": "NO_SHARD"}, None),
        "an optimizer not of torch": ({}, None),
        "bf16, parameters never used": (bf16, "settle"),
    }
    for name, (options, expected) in configs.items():
        torch.manual_seed(0)
        model = TiedLM().to(DEVICE)
        if expected is None:  # every parameter used: no usage flag to read
            del model.skipped
            for block in model.blocks:
                del block.unused
        shard_model(model, auto_wrap_policy={Block}, device=DEVICE, **options)
        scheduler = get_scheduler(model)
        adamw = AdamWOfOurs if name == "an optimizer not of torch" else torch.optim.AdamW
        optimizer = adamw(model.parameters(), lr=1e-3)
        synced_in = None
        for index, batch in enumerate(make_batches(5, 4).to(DEVICE)):
            torch.cuda.set_sync_debug_mode("error" if index >= 2 else "default")
            try:
                lm_loss(model, batch).backward()
                scheduler.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad()
            except RuntimeError as error:
                if "synchronizing" not in str(error):
                    raise
                synced_in = traceback.extract_tb(error.__traceback__)[-1].name
                if synced_in != expected:
                    raise AssertionError(f"{name}, step {index}: a synchronizing call in {synced_in}()") from error
                break
            finally:
                torch.cuda.set_sync_debug_mode("default")
        scheduler.close()
        if synced_in != expected:
            raise AssertionError(f"{name}: expected the usage flags' read in {expected}(), saw none")
    clean = ", ".join(name for name, (_, expected) in configs.items() if expected is None)
    return f"{clean}: no synchronizing call; parameters never used: only settle()"


def step_time_vs_fsdp2() -> str:
    """Median step time of a 12-layer 1024-wide MLP stack in bf16: ours against FSDP2's
    ``fully_shard`` (a report; no threshold)."""
    _needs_cuda()
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            *[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(12)]
        )

    def median_step(model: nn.Module) -> float:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(16, 1024, device=DEVICE)
        times = []
        for _ in range(15):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(x).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times[5:])[len(times[5:]) // 2]

    ours = build().to(DEVICE)
    shard_model(ours, auto_wrap_policy={nn.Sequential}, device=DEVICE, mixed_precision=MixedPrecision(torch.bfloat16))
    ours_time = median_step(ours)
    get_scheduler(ours).close()
    theirs = build().to(DEVICE)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in theirs:
        fully_shard(layer, mp_policy=policy)
    fully_shard(theirs, mp_policy=policy)
    theirs_time = median_step(theirs)
    return f"ours {ours_time * 1e3:.2f} ms, FSDP2 {theirs_time * 1e3:.2f} ms ({ours_time / theirs_time:.2f}x)"


def watchdog_leaves_a_healthy_job_alone() -> str:
    """A watched engine with a short collective limit trains 20 steps and closes cleanly."""
    torch.manual_seed(0)
    model = TiedLM().to(DEVICE)
    shard_model(model, auto_wrap_policy={Block}, device=DEVICE, cpu_offload=True, collective_timeout=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in make_batches(20, 4).to(DEVICE):
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    get_scheduler(model).close()
    return "20 steps, no report"


def _losses(root: str) -> dict[int, float]:
    lines = Path(root, "losses", "rank0.jsonl").read_text().splitlines()
    return {entry["step"]: entry["loss"] for entry in map(json.loads, lines) if "loss" in entry}


def torchrun_restart() -> str:
    """``torchrun --max-restarts 1`` with torch's defaults (c10d rendezvous, the agent's store kept
    across restarts): the rank is SIGKILLed at step 7, the restart creates its NCCL group on the
    same store and resumes from ``last``; its losses equal an uninterrupted run's."""
    _needs_cuda()
    job = [str(TESTS / "restart_job.py"), "--accelerator", "cuda", "--devices", "1"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "1"]
    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    with tempfile.TemporaryDirectory() as restarted, tempfile.TemporaryDirectory() as uninterrupted:
        for command in (
            [*torchrun, *job, "--root", restarted, "--kill-step", "7", "--kill-rank", "0"],
            [sys.executable, *job, "--root", uninterrupted],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_clean_env())
            if done.returncode != 0:
                raise RuntimeError(f"{command[1:4]} failed: {(done.stdout + done.stderr)[-3000:]}")
        got, want = _losses(restarted), _losses(uninterrupted)
        worst = max(abs(got[step] - want[step]) for step in range(12))
        if worst > 1e-5:
            raise AssertionError(f"losses differ from the uninterrupted run's by up to {worst:.3g}")
    return f"restarted once, resumed at step 6; losses within {worst:.1g} of an uninterrupted run"


def _clean_env() -> dict[str, str]:
    """This process's environment without the process group variables it set for itself."""
    return {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}


CHECKS: list[tuple[str, Callable[[], str]]] = [
    ("patterns, FULL_SHARD + CPU offload", lambda: patterns(cpu_offload=True)),
    ("patterns, SHARD_GRAD_OP", lambda: patterns(sharding_strategy="SHARD_GRAD_OP")),
    ("engine fp32", engine_parity),
    ("engine CPU offload (pinned)", lambda: engine_parity(cpu_offload=True)),
    ("engine bf16 mixed", lambda: engine_parity(mixed_precision=MixedPrecision(*[torch.bfloat16] * 3))),
    ("engine fp16 reductions", lambda: engine_parity(mixed_precision=MixedPrecision(*[torch.float16] * 3))),
    ("CPU-built model, sync_module_states", cpu_built_model),
    ("sharded checkpoint, 1x1 HSDP + offload", checkpoints_hsdp_offload),
    ("Lightning bf16-mixed", lambda: lightning("bf16-mixed")),
    ("Lightning bf16-true", lambda: lightning("bf16-true")),
    ("Lightning 16-mixed (sharded scaler)", lambda: lightning("16-mixed")),
    ("torch.compile per block", compiled_blocks),
    ("watchdog on a healthy job", watchdog_leaves_a_healthy_job_alone),
    ("memory account vs max_memory_allocated", memory_account),
    ("no host sync in a step (sync debug mode)", no_host_sync_in_a_step),
    ("step time vs FSDP2", step_time_vs_fsdp2),
    ("torchrun restart on the agent's store (NCCL)", torchrun_restart),
]


MULTI_RANK_CHECKS: list[tuple[str, Callable[[], str]]] = [
    ("patterns, FULL_SHARD", patterns),
    ("patterns, FULL_SHARD + CPU offload", lambda: patterns(cpu_offload=True)),
    ("engine fp32", engine_parity),
    ("engine bf16 mixed", lambda: engine_parity(mixed_precision=MixedPrecision(*[torch.bfloat16] * 3))),
    ("tensor parallel 1 x world, fp32", lambda: tensor_parallel(dtype=torch.float32)),
    (
        "tensor parallel 1 x world, bf16 params",
        lambda: tensor_parallel(dtype=torch.float32, param_dtype=torch.bfloat16),
    ),
]


def tensor_parallel(**case) -> str:
    """Tensor parallel inside, the engine across: Lightning's example's plan on a 1 x world mesh
    (SequenceParallel, loss_parallel) against the plain model in one process on the global batch."""
    from test_tensor_parallel import tolerances, train_two_d

    if DEVICE.type == "cuda" and dist.get_backend() == "gloo":
        raise TorchCannot(
            "DTensor's all-gather of CUDA tensors over gloo crashes in torch (SIGSEGV, pytorch#152645): "
            "runs with NCCL on two or more GPUs"
        )
    case = {"dp": 1, "tp": dist.get_world_size(), "sequence_parallel": True, "loss_parallel": True, **case}
    errors, limits = train_two_d(case, DEVICE), tolerances(case)
    if any(errors[key] > limit for key, limit in limits.items()):
        raise AssertionError(f"relative errors {errors} above {limits}")
    return "relative errors " + ", ".join(f"{key} {value:.1e}" for key, value in errors.items())


def _run_checks(
    checks: list[tuple[str, Callable[[], str]]], prefix: str = "", echo: bool = False
) -> list[tuple[str, str, str]]:
    """``(name, result, detail)`` per check; a check that raises ``NotImplementedError`` is a skip on
    the CPU only: with CUDA present every check must run; one torch cannot run here (``TorchCannot``)
    is a skip that names the upstream issue. ``echo`` prints each row as it ends (a run
    cut off by a time limit still shows what it reached)."""
    rows = []
    for name, check in checks:
        try:
            row = ("pass", check())
        except TorchCannot as limit:
            row = ("skip", str(limit))
        except NotImplementedError as unimplemented:
            row = ("skip" if DEVICE.type == "cpu" else "FAIL", f"not implemented: {unimplemented}")
        except Exception as error:  # a row per failure; the traceback follows the table
            row = ("FAIL", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            traceback.print_exc(file=sys.stderr)
        rows.append((prefix + name, *row))
        if echo:
            sys.stdout.write(f"| {rows[-1][0]} | {rows[-1][1]} | {rows[-1][2]} |\n")  # one write: ranks share a pipe
            sys.stdout.flush()
    return rows


def _multi_rank_worker(
    rank: int, world: int, backend: str, device_type: str, rendezvous: str, out: str, only: str | None
) -> None:
    """One rank of the multi-rank checks (those whose name holds ``only``, if given); its rows go to
    ``out``/rank<k>.json and are printed as they end; a crash in native code prints every thread's
    Python stack (faulthandler)."""
    global DEVICE
    faulthandler.enable(all_threads=True)
    if device_type == "cuda":
        DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    options = {"device_id": DEVICE} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world, **options)
    try:
        checks = [check for check in MULTI_RANK_CHECKS if not only or only in check[0]]
        rows = _run_checks(checks, prefix=f"rank {rank}, world {world} ({backend}): ", echo=True)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))


def multi_rank_rows(device_type: str, only: str | None = None) -> list[tuple[str, str, str]]:
    """The multi-rank checks on fresh spawned ranks: NCCL with one GPU per rank where there are two or
    more; two ranks over gloo on one GPU (CUDA tensors) or on the CPU otherwise. A rank's row is a
    pass only if every rank passed."""
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    world, backend = (gpus, "nccl") if gpus >= 2 else (2, "gloo")
    with tempfile.TemporaryDirectory() as folder:
        args = (world, backend, device_type, str(Path(folder) / "rendezvous"), folder, only)
        mp.start_processes(_multi_rank_worker, args=args, nprocs=world, start_method="spawn")
        per_rank = [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(world)]
    rows = []
    for index, (name, result, detail) in enumerate(per_rank[0]):
        name = name.split(", ", 1)[1]
        failed = [rank for rank in range(world) if per_rank[rank][index][1] == "FAIL"]
        rows.append((name, "FAIL" if failed else result, f"ranks {failed} failed" if failed else detail))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every check at world 1, then the multi-rank checks; print a Markdown table; 1 if any failed."""
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with gloo (the CUDA-only rows skip)")
    parser.add_argument(
        "-k", dest="only", help="run only the checks (world 1 and multi-rank) whose name holds this text (a rerun)"
    )
    parser.add_argument("--no-multi-rank", action="store_true", help="skip the spawned multi-rank checks")
    args = parser.parse_args(argv)
    checks = [check for check in CHECKS if not args.only or args.only in check[0]]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if args.cpu:
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu, or on a machine with a GPU", file=sys.stderr)
            return 2
        DEVICE = torch.device("cuda", 0)
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=DEVICE)
    print(
        f"device: {torch.cuda.get_device_name(DEVICE) if DEVICE.type == 'cuda' else 'CPU'}, torch {torch.__version__}"
    )
    print("| check | result | detail |\n|---|---|---|")
    rows = _run_checks(checks, echo=True)
    dist.destroy_process_group()
    try:
        multi_rank = [] if args.no_multi_rank else multi_rank_rows(DEVICE.type, args.only)
    except Exception as error:  # a rank that died: one failed row
        multi_rank = [("multi-rank checks", "FAIL", f"{type(error).__name__}: {str(error).splitlines()[0]}")]
        traceback.print_exc(file=sys.stderr)
    for name, result, detail in multi_rank:
        print(f"| {name} | {result} | {detail} |", flush=True)
    rows += multi_rank
    failed = sum(result == "FAIL" for _, result, _ in rows)
    print(f"{len(rows) - failed} of {len(rows)} checks did not fail" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
