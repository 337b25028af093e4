"""The memory plan of a 2-D run (issue 50): tensor parallel inside, the engine's sharding across.
Shards and optimizer state against the exact formula (TP-split tensors divided by tp x dp, replicated
ones by dp), compute per rank, the peak against real 2-D runs (Lightning at 2x2; sequence parallel at
1x2), the command, and bad input."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from test_plan import Layer, Stack
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tp_models import SEQ, Block, TinyLM, lm_loss, parallelize_sequence_on_mesh

from fsdp_strategy.plan import plan
from fsdp_strategy.plan.cli import main as fsdp_plan
from fsdp_strategy.plan.tracker import LiveBytes

ROOT = Path(__file__).resolve().parents[1]


def split_layers(model: Stack, device_mesh) -> Stack:
    """Each layer's MLP split over tensor parallel (``up`` by columns, ``down`` by rows); the head whole."""
    for layer in model.layers:
        parallelize_module(layer, device_mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _local_shape(name: str, shape: torch.Size, tp: int) -> tuple[int, ...]:
    """A parameter's shape on one tensor-parallel rank under ``split_layers``."""
    if ".up." in name:  # colwise: weight and bias split on dim 0
        return (shape[0] // tp, *shape[1:])
    if name.endswith("down.weight"):  # rowwise: weight split on dim 1, bias replicated
        return (shape[0], shape[1] // tp)
    return tuple(shape)


@pytest.mark.parametrize("dp, tp", [(2, 4), (4, 2), (1, 2)])
def test_tensor_parallel_shards_are_divided_by_tp_and_dp_exactly(dp, tp):
    model = Stack()
    result = plan(
        model, torch.empty(512, 48, device="meta"), world_size=dp * tp, data_parallel_size=dp,
        tensor_parallel_size=tp, parallelize_fn=split_layers, auto_wrap_policy={Layer},
    )  # fmt: skip
    local = {name: _local_shape(name, p.shape, tp) for name, p in model.named_parameters()}
    shard_numels = [math.ceil(shape[0] / dp) * math.prod(shape[1:]) for shape in local.values()]
    assert result.parts["parameter shards"] == 4 * sum(shard_numels) == result.shard_bytes
    assert result.parts["optimizer state"] == 4 * (2 * sum(shard_numels) + len(shard_numels))
    assert sum(result.parts.values()) == result.peak_bytes
    assert result.settings["data_parallel_size"] == dp and result.settings["tensor_parallel_size"] == tp
    assert result.strategy_kwargs["tensor_parallel_size"] == tp
    # this rank's matmuls: the split ones on 1/tp of their columns or rows, the head whole
    matmuls = [math.prod(local[f"{n}.weight"]) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert result.flops_per_step == 2 * 512 * (3 * sum(matmuls) - matmuls[0])
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model given is not touched


def test_a_plan_then_a_two_d_run_in_the_same_process_family(tmp_path):
    """The plan's fake world leaves DTensor nothing cached: forked ranks of a real 2-D job right after a
    plan once sent their tensor-parallel collectives to the fake world's groups ("Could not resolve the
    process group"), and measured peaks of Lightning 2x2 runs against the plan's."""
    sys.path[:0] = [str(ROOT / "benchmarks")]
    from plan_accuracy import configurations, measure, predict

    wanted = {
        ("FULL_SHARD", "32-true", False),
        ("FULL_SHARD", "bf16-mixed", True),
        ("SHARD_GRAD_OP", "bf16-mixed", True),
    }
    grid = [c for c in configurations(["gpt-tp"], [4]) if (c["sharding"], c["precision"], c["checkpointing"]) in wanted]
    predicted = [predict(c) for c in grid]
    measured = measure(grid, 4, tmp_path)
    for config, want, got in zip(grid, measured, predicted):
        # within 0.01 % (benchmarks/plan_accuracy.py); recomputation was 3-8 % low while the engine took fake
        # views of the gathered parameters for replaced ones (is_set_to on fake tensors)
        assert abs(got - want) <= 0.02 * want, (config, got, want)


def _real_peak(rank: int, world: int, which: str) -> int:
    """Live bytes of the second step of a real engine run at 1x2 (``which``: "sequence" or "head"), counted
    by the plan's own counter."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_strategy.engine import shard_model

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    model, batch, policy = REAL_RUNS[which]()
    model = {"sequence": parallelize_sequence_on_mesh, "head": split_head}[which](model, mesh)
    shard_model(model, auto_wrap_policy=policy, process_group=mesh["data_parallel"].get_group())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        if step == 1:
            live = LiveBytes(dict)
            state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            live.track([*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *state])
            live.track([batch])
            live.__enter__()
        loss = model(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    live.__exit__(None, None, None)
    return live.peak.bytes


class SequenceLM(TinyLM):
    """TinyLM on its own loss (the tokens predict themselves)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(super().forward(tokens), tokens)


@pytest.mark.parametrize("which", ["sequence", "head"])
def test_a_plan_is_the_peak_of_a_real_run(tmp_path, which):
    """At 1x2, the plan against the live bytes of a real engine run counted by the same counter, the second
    step: sequence parallel (norms on sequence-sharded activations), and a large split head, whose first
    operators DTensor propagates on global-shape stand-ins in the plan's fake mode (counted, the plan's
    first step peaked at a whole head)."""
    measured = run_ranks(_real_peak, 2, tmp_path, which, env={"FSDP_CUSTOM_GLOO_P2P": "0"})[0]
    model, batch, policy = REAL_RUNS[which]()
    parallelize_fn = {"sequence": parallelize_sequence_on_mesh, "head": split_head}[which]
    result = plan(
        model, batch, world_size=2, tensor_parallel_size=2, parallelize_fn=parallelize_fn, auto_wrap_policy=policy
    )
    assert abs(result.peak_bytes - measured) <= 0.01 * measured, (result.peak_bytes, measured)


def test_fsdp_plan_plans_two_d_and_refuses_bad_input(capsys):
    assert fsdp_plan(
        ["tp_models:TinyLM", "--input", f"8x{SEQ}:long", "--world-size", "4",
         "--tensor-parallel-size", "2", "--parallelize", "tp_models:parallelize_on_mesh", "--wrap", "tp_models.Block"]
    ) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "data_parallel_size=2" in out and "tensor_parallel_size=2" in out and "peak per rank" in out, out
    for argv, expected in [
        (["gpt2", "--world-size", "4", "--tensor-parallel-size", "2"], "has no built-in tensor-parallel plan"),
        (["gpt2", "--world-size", "4", "--data-parallel-size", "2"], "give --tensor-parallel-size"),
        (["llama-7b", "--world-size", "4", "--tensor-parallel-size", "3"], "does not divide world_size=4"),
        (["llama-7b", "--world-size", "4", "--no-sequence-parallel"], "give --tensor-parallel-size"),
        (
            [
                "llama-7b",
                "--world-size",
                "4",
                "--tensor-parallel-size",
                "2",
                "--parallelize",
                "tp_models:parallelize_on_mesh",
            ],
            "parallelize_fn parallelize_on_mesh on LlamaForCausalLM failed: AttributeError",
        ),
    ]:
        assert fsdp_plan(argv) == 2
        assert expected in capsys.readouterr().err
    batch = torch.zeros(8, SEQ, dtype=torch.long)
    with pytest.raises(ValueError, match="needs the model's tensor-parallel plan"):
        plan(TinyLM(), batch, world_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="multiply to the world size"):
        plan(TinyLM(), batch, world_size=4, data_parallel_size=3, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="parallelize_fn returned NoneType"):
        plan(TinyLM(), batch, world_size=2, tensor_parallel_size=2, parallelize_fn=lambda m, mesh: None)
    with pytest.raises(ValueError, match="with a hybrid sharding_strategy"):
        plan(TinyLM(), batch, world_size=2, tensor_parallel_size=2, sharding_strategy="HYBRID_SHARD")
    with pytest.raises(TypeError, match="parallelize_fn is a dict"):
        plan(TinyLM(), batch, world_size=2, tensor_parallel_size=2, parallelize_fn={"a": 1})
    with pytest.raises(RuntimeError, match="needs tensor parallel's loss_parallel"):
        plan(SplitLoss(), batch, world_size=2, tensor_parallel_size=2, parallelize_fn=split_logits)
    with pytest.raises(ValueError, match="chooses among 1-D settings"):
        plan(TinyLM(), batch, world_size=2, tensor_parallel_size=2, auto_wrap_policy="auto", memory_budget="1GiB")


def _preset_plan_against_one_process(rank: int, world: int, sequence_parallel: bool) -> tuple[float, float]:
    import copy

    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_strategy.plan.preset_plans import llama_tensor_parallel

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    llama_tensor_parallel(model, mesh, sequence_parallel)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, expected = model(input_ids=tokens, labels=tokens).loss, reference(input_ids=tokens, labels=tokens).loss
    (loss + 0).backward()
    expected.backward()
    worst = 0.0
    for param, other in zip(model.parameters(), reference.parameters()):
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        worst = max(worst, float((grad - other.grad).abs().max() / other.grad.abs().max().clamp_min(1e-30)))
    return abs(float(loss.detach()) - float(expected.detach())), worst


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_llama_presets_plan_trains_as_one_process(tmp_path, sequence_parallel):
    """The plan ``fsdp-plan llama-* --tensor-parallel-size`` applies is a correct one: a real 1x2 run of a
    small Hugging Face Llama under it computes one process's loss and gradients (float64)."""
    for loss_error, grad_error in run_ranks(_preset_plan_against_one_process, 2, tmp_path, sequence_parallel):
        assert loss_error < 1e-12 and grad_error < 1e-9, (loss_error, grad_error)


class BigHead(nn.Module):
    """A small body under a large output projection: what a language model's head is."""

    def __init__(self, vocabulary: int = 32768, width: int = 64) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, width), nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens)).logsumexp(-1).mean()


def split_head(model: BigHead, device_mesh) -> BigHead:
    return parallelize_module(model, device_mesh["tensor_parallel"], {"head": ColwiseParallel()})


class SplitLoss(TinyLM):
    """TinyLM whose loss runs on vocabulary-split logits (tensor parallel's loss_parallel)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return lm_loss(super().forward(tokens), tokens)


def split_logits(model: TinyLM, device_mesh) -> TinyLM:
    from tp_models import parallelize

    return parallelize(model, device_mesh["tensor_parallel"], loss_parallel=True)


REAL_RUNS = {
    "sequence": lambda: (SequenceLM(), torch.zeros(256, SEQ, dtype=torch.long), {Block}),
    "head": lambda: (BigHead(), torch.zeros(2, 4, dtype=torch.long), None),
}


def test_no_rank_holds_a_whole_tensor_parallel_parameter_in_a_plan():
    """DTensor propagates each new operator on global-shape stand-ins in the current fake mode (the
    plan's): counted, the setup of a model with an 8 MiB head split 8 ways peaked above a whole head."""
    model = BigHead()
    result = plan(
        model, torch.zeros(2, 4, dtype=torch.long), world_size=8, tensor_parallel_size=8, parallelize_fn=split_head
    )
    whole = 4 * model.head.weight.numel()
    assert result.parts["parameter shards"] == whole // 8 + 4 * model.embed.weight.numel(), result.parts
    assert result.phase != "setup" and result.peak_bytes < whole, result
