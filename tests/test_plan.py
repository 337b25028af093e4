"""The memory plan: its parts against the exact formula, its peak against real runs (world 2), the
settings a budget chooses against a real Lightning job, the command, and bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import excerpt
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]
from plan_accuracy import MODELS, configurations, measure, predict, strategy_kwargs  # noqa: E402

from fsdp_strategy import FSDPCustomStrategy  # noqa: E402
from fsdp_strategy.plan import plan  # noqa: E402
from fsdp_strategy.plan.cli import main as fsdp_plan  # noqa: E402
from fsdp_strategy.wrap import ModuleNames  # noqa: E402


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, width: int = 48, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[Layer(width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x)).logsumexp(-1).mean()


@pytest.mark.parametrize("world", [1, 3, 1024])
def test_shards_and_optimizer_state_are_the_exact_bytes(world):
    model = Stack()
    result = plan(model, torch.empty(512, 48, device="meta"), world_size=world, auto_wrap_policy={Layer})
    # dim-0 shards: ceil(rows / N) rows each ([Note: shard layout])
    shard_numels = [math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) for p in model.parameters()]
    assert result.phase == "backward", result  # the activations make backward the peak
    assert result.parts["parameter shards"] == 4 * sum(shard_numels) == result.shard_bytes
    assert result.parts["optimizer state"] == 4 * (2 * sum(shard_numels) + len(shard_numels))  # AdamW: 2 moments + step
    assert sum(result.parts.values()) == result.peak_bytes
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model given is not touched
    # every rank runs the whole batch: 2*B*in*out per matmul, forward, grad input (not for the first
    # layer, whose input needs none) and grad weight
    matmuls = [m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    assert result.flops_per_step == 2 * 512 * (3 * sum(matmuls) - matmuls[0])


class Attention(nn.Module):
    def __init__(self, heads: int = 4, width: int = 32) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(width, 3 * width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().square().mean()


class CountedLayer(Layer):
    """A ``Layer`` that counts its forward calls (class-wide) and knows its index, as Hugging Face's
    decoder layers keep ``layer_idx``; ``window`` differs per layer where a model makes it so."""

    calls = 0  # on fake tensors: the planned steps, what a plan's time grows with
    meta_calls = 0  # on meta tensors: the plan's check that every layer runs alike (shapes only)

    def __init__(self, width: int, layer_idx: int, window: int = 0) -> None:
        super().__init__(width)
        self.layer_idx, self.window = layer_idx, window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(x, FakeTensor):
            CountedLayer.calls += 1
        else:
            CountedLayer.meta_calls += 1
        return super().forward(x)


def counted_stack(depth: int, alternating: bool = False) -> nn.Module:
    model = Stack(width=24, depth=1)
    model.layers = nn.Sequential(*[CountedLayer(24, i, window=i % 2 if alternating else 0) for i in range(depth)])
    return model


BF16, EVERY = {"precision": "bf16-mixed"}, range(24)


def _planned(model: nn.Module, **kwargs) -> tuple:
    result = plan(model, torch.empty(64, 24, device="meta"), world_size=3, **kwargs)
    numbers = (result.peak_bytes, result.parts, result.phase, result.unit, result.host_bytes)
    return (*numbers, result.sent_bytes_per_step, result.flops_per_step, result.shard_bytes)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"auto_wrap_policy": {CountedLayer}},
        {
            "auto_wrap_policy": {CountedLayer},
            "activation_checkpointing_policy": {CountedLayer},
            "precision": "bf16-true",
        },
        {"auto_wrap_policy": {CountedLayer}, "sharding_strategy": "SHARD_GRAD_OP", "cpu_offload": True},
        {
            "auto_wrap_policy": {nn.Linear},
            "activation_checkpointing_policy": ModuleNames(f"layers.{i}" for i in range(18)),
        },
        {"precision": "bf16-true"},  # the whole model one unit
    ],
    ids=["units", "recomputed-bf16", "grad-op-offload", "linear-units-named-recomputation", "one-unit"],
)
def test_identical_layers_are_planned_from_a_few_and_counted_exactly(monkeypatch, kwargs):
    from fsdp_strategy.plan import repeats

    counted = _planned(counted_stack(24), **kwargs)
    monkeypatch.setattr(repeats, "MIN_LAYERS", 10**9)  # every layer run, as before [Note: identical layers ...]
    assert counted == _planned(counted_stack(24), **kwargs)


class EveryEighthWide(CountedLayer):
    """Every eighth layer (by its ``layer_idx``, as Hugging Face reads ``layer_types[layer_idx]``) keeps a
    wide intermediate: layers 0 to 6, all a short plan runs, do not show it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_idx % 8 == 7:
            x = x + torch.cat([x] * 8, dim=-1).relu().reshape(*x.shape, 8).mean(-1)
        return super().forward(x)


class FirstHalf(nn.Module):
    """A model that runs only the first half of its layers (an early exit)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[CountedLayer(24, i) for i in range(24)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[:12](x).square().mean()


@pytest.mark.parametrize("build", ["every_eighth", "first_half"])
def test_layers_that_run_otherwise_by_their_index_are_planned_every_one(monkeypatch, build):
    from fsdp_strategy.plan import repeats

    def model() -> nn.Module:
        if build == "first_half":
            return FirstHalf()
        stack = counted_stack(24)
        stack.layers = nn.Sequential(*[EveryEighthWide(24, i) for i in range(24)])
        return stack

    counted = _planned(model(), auto_wrap_policy={CountedLayer})
    monkeypatch.setattr(repeats, "MIN_LAYERS", 10**9)
    assert counted == _planned(model(), auto_wrap_policy={CountedLayer})


def test_planning_n_identical_layers_costs_what_a_few_cost():
    calls = {}
    for depth in (24, 64):
        CountedLayer.calls = CountedLayer.meta_calls = 0
        plan(counted_stack(depth), torch.empty(64, 24, device="meta"), world_size=8, auto_wrap_policy={CountedLayer})
        calls[depth] = CountedLayer.calls
        assert CountedLayer.meta_calls == depth  # one forward on meta tensors checks that every layer runs alike
    assert calls[24] == calls[64] == 2 * (5 + 6 + 7)  # two steps of the 5, 6 and 7 layer plans
    CountedLayer.calls = 0  # layers that differ (every other one another window) are all run
    plan(counted_stack(24, alternating=True), torch.empty(64, 24, device="meta"), world_size=8)
    assert CountedLayer.calls == 2 * 24


def test_flops_count_attention_as_its_matmuls():
    # the CPU flash kernel by the CUDA kernels' formula: two matmuls forward, five backward (the scores
    # are recomputed), 2*b*h*s*s*d each (h*d = w); the projection: forward and grad weight
    b, s, w = 2, 64, 32
    result = plan(Attention(), torch.empty(b, s, w), world_size=2)
    assert result.flops_per_step == 14 * b * s * s * w + 2 * 2 * b * s * w * 3 * w


def test_an_optimizer_that_makes_its_state_at_construction_is_counted_as_optimizer_state():
    model = Stack()
    result = plan(model, torch.empty(512, 48), world_size=1, optimizer=torch.optim.Adagrad, auto_wrap_policy={Layer})
    numels = [p.numel() for p in model.parameters()]
    assert result.phase == "backward"
    assert result.parts["optimizer state"] == 4 * (sum(numels) + len(numels))  # Adagrad: a sum per element + step


def test_bf16_true_halves_the_shards_and_a_plan_reports_its_settings():
    full = plan(Stack(), torch.empty(512, 48), world_size=2, auto_wrap_policy={Layer})
    half = plan(Stack(), torch.empty(512, 48), world_size=2, precision="bf16-true", auto_wrap_policy={Layer})
    assert half.parts["parameter shards"] * 2 == full.parts["parameter shards"]
    assert "precision=bf16-true" in str(half) and "peak per rank" in str(half)


def test_plan_predicts_the_peak_of_real_runs_within_two_percent(tmp_path):
    # two models (the GPT example's LightningModule, Hugging Face GPT-2 from a config) at world 2
    grid = [
        c
        for c in configurations(["gpt", "gpt2"], [2])
        if (c["sharding"], c["precision"], c["checkpointing"])
        in {
            ("FULL_SHARD", "32-true", False),
            ("SHARD_GRAD_OP", "bf16-mixed", True),
            ("HYBRID_SHARD", "bf16-mixed", True),
        }
    ]
    predicted = [predict(c) for c in grid]
    measured = measure(grid, 2, tmp_path)
    for config, want, got in zip(grid, measured, predicted):
        # the bound is 10 %; the plan is within 0.1 % (benchmarks/plan_accuracy.py), and 2 % catches
        # held activations (a FLOP counter's module hooks once kept recomputed blocks' saved tensors: +7 % here)
        assert abs(got - want) <= 0.02 * want, (config, got, want)


def test_a_budget_between_two_configurations_chooses_one_that_fits_and_is_not_exceeded(tmp_path):
    module, batch, blocks = MODELS["gpt"]()
    fastest = plan(module, batch, world_size=2, sharding_strategy="SHARD_GRAD_OP")  # one unit, nothing recomputed
    lighter = plan(
        module, batch, world_size=2, auto_wrap_policy=blocks, activation_checkpointing_policy=blocks
    )  # per block, every block recomputed
    budget = (fastest.peak_bytes + lighter.peak_bytes) // 2
    job = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "budget_job.py"), str(budget)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert job.returncode == 0, excerpt(job.stdout, 3000) + excerpt(job.stderr, 3000)
    chosen = json.loads(job.stdout.split("CHOSEN ")[1].splitlines()[0])
    assert chosen["measured"] <= budget, (chosen, budget)
    assert chosen["per_block"] and chosen["units"] == 5  # the whole model as one unit does not fit
    assert "auto_wrap_policy='auto' chose" in job.stdout + job.stderr and "fits, chosen" in job.stdout + job.stderr


def test_a_budget_is_met_where_recomputing_every_block_is_not_the_lightest():
    # Llama: recomputing the last block too adds its recomputation and saves nothing, so 3 of 3 blocks
    # recomputed peaks above 2 of 3; a budget between the two must not be told that nothing fits
    module, batch, blocks = MODELS["llama"]()
    names = [name for name, m in module.named_modules() if type(m) in blocks]
    light = {"auto_wrap_policy": blocks, "cpu_offload": True}
    two = plan(module, batch, world_size=2, activation_checkpointing_policy=ModuleNames(names[:2]), **light)
    three = plan(module, batch, world_size=2, activation_checkpointing_policy=ModuleNames(names), **light)
    assert two.peak_bytes < three.peak_bytes
    budget = (two.peak_bytes + three.peak_bytes) // 2
    chosen = plan(module, batch, world_size=2, auto_wrap_policy="auto", memory_budget=budget, memory_reserve=0)
    assert chosen.peak_bytes == two.peak_bytes and chosen.strategy_kwargs["cpu_offload"]
    assert chosen.strategy_kwargs["activation_checkpointing_policy"] == ModuleNames(names[:2])
    # [Note: memory reserve]: by default the same budget is planned less its reserve, and nothing fits it;
    # one that leaves the reserve above the peak chooses the same, saying so and printing it ready to paste
    from fsdp_strategy.plan.budget import budget_with, reserve_of

    with pytest.raises(ValueError, match=r"nothing fits .* planned, the rest kept by memory_reserve"):
        plan(module, batch, world_size=2, auto_wrap_policy="auto", memory_budget=budget)
    roomy = budget_with(two.peak_bytes, None)
    chosen = plan(module, batch, world_size=2, auto_wrap_policy="auto", memory_budget=roomy)
    assert two.peak_bytes == chosen.peak_bytes <= roomy - reserve_of(roomy, None)
    text = str(chosen)  # one argument per line, lines that fit a terminal, the recomputed blocks in order
    assert "memory_reserve: the CUDA context, NCCL, fragmentation)" in text, text
    assert all(len(line) <= 120 for line in text.splitlines()), text
    assert text.splitlines()[0] == "memory plan (world_size=2, precision=32-true)", text
    pasted = text.split("as strategy arguments:\n")[1]
    assert f"activation_checkpointing_policy=ModuleNames({names[:2]!r})" in pasted, pasted
    namespace = {"FSDPCustomStrategy": dict, "ModuleNames": ModuleNames, **{cls.__name__: cls for cls in blocks}}
    assert eval(pasted, namespace) == chosen.strategy_kwargs, (pasted, chosen.strategy_kwargs)


def test_the_default_reserve_is_the_documented_one():
    """[Note: memory reserve]: 2 GiB (a tenth under 20 GiB) plus 5 % of the budget; budget_with inverts it."""
    from fsdp_strategy.plan.budget import budget_with, reserve_of

    gib = 1 << 30
    assert reserve_of(80 * 10**9, None) == 2 * gib + int(0.05 * 80 * 10**9)  # 5.73 GiB of an 80 GB card
    assert reserve_of(10 * gib, None) == gib + int(0.05 * 10 * gib)
    for peak in (3 * gib, 70 * gib, 5 << 20):
        smallest = budget_with(peak, None)
        assert smallest - reserve_of(smallest, None) >= peak > (smallest - 64) - reserve_of(smallest - 64, None)


def test_module_names_print_in_the_order_given_and_runs_as_ranges():
    assert repr(ModuleNames([f"m.layers.{i}" for i in range(3)])) == 'ModuleNames([f"m.layers.{i}" for i in range(3)])'
    assert repr(ModuleNames(["m.9", "m.10", "m.11"])) == 'ModuleNames([f"m.{i}" for i in range(9, 12)])'
    assert repr(ModuleNames(["b.2", "a"])) == "ModuleNames(['b.2', 'a'])"  # as given, not in hash order
    assert eval(repr(ModuleNames(["m.9", "m.10", "m.11"])), {"ModuleNames": ModuleNames}) == {"m.9", "m.10", "m.11"}


def test_nothing_fits_names_the_smallest_budget_and_world():
    with pytest.raises(ValueError, match=r"nothing fits memory_budget=1.00 KiB per rank at 2 ranks.*peak at"):
        plan(Stack(), torch.empty(64, 48), world_size=2, auto_wrap_policy="auto", memory_budget="1KiB")


def test_fsdp_plan_command_prints_a_plan_and_refuses_bad_input(capsys):
    with pytest.raises(SystemExit):
        fsdp_plan(["--help"])
    assert "fsdp-plan: will it fit?" in capsys.readouterr().out  # plain text: no RST double backticks
    assert fsdp_plan(["gpt2", "--world-size", "8", "--seq-len", "64", "--precision", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    assert "peak per rank" in out and "world_size=8" in out and "GPT2Block" in out
    for argv, words in (
        (["gpt2", "--world-size", "0"], "world_size=0"),
        (["nonsense", "--world-size", "2"], "neither a preset"),
        (["gpt2", "--world-size", "2", "--batch", "0"], "--batch=0 must be at least 1"),
        (["gpt2", "--world-size", "2", "--reserve", "2GiB"], "give --budget too"),
        (["test_plan:Stack", "--world-size", "2", "--input", "8x-4"], "positive sizes"),
        (
            ["test_plan:Stack", "--world-size", "2", "--input", "8x48", "--activation-checkpointing"],
            "needs class",
        ),
    ):
        assert fsdp_plan(argv) == 2, argv
        assert words in capsys.readouterr().err, argv


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x[x > 0].reshape(-1, 4)).sum()


def test_bad_input_is_a_clear_error():
    x = torch.empty(8, 48)
    manual = MODELS["gpt"]()[0]
    manual.automatic_optimization = False
    with pytest.raises(ValueError, match="uses manual optimization"):
        plan(manual, torch.zeros(2, 65, dtype=torch.long), world_size=2)
    with pytest.raises(ValueError, match="world_size=0 must be a positive int"):
        plan(Stack(), x, world_size=0)
    with pytest.raises(ValueError, match="memory_budget='lots' is not a size"):
        plan(Stack(), x, world_size=2, auto_wrap_policy="auto", memory_budget="lots")
    with pytest.raises(ValueError, match="auto_wrap_policy='auto' needs memory_budget"):
        plan(Stack(), x, world_size=2, auto_wrap_policy="auto")
    with pytest.raises(ValueError, match="precision='fp8'"):
        plan(Stack(), x, world_size=2, precision="fp8")
    with pytest.raises(RuntimeError, match="reads tensor values"):
        plan(ReadsValues(), torch.empty(8, 4), world_size=2)
    with pytest.raises(ValueError, match="needs memory_budget .* and example_batch"):
        FSDPCustomStrategy(auto_wrap_policy="auto", memory_budget="1GiB")
    with pytest.raises(ValueError, match="read with auto_wrap_policy='auto' only"):
        FSDPCustomStrategy(memory_budget="1GiB")
    with pytest.raises(ValueError, match="names modules \\['layers.9'\\]"):
        plan(Stack(), x, world_size=2, activation_checkpointing_policy=ModuleNames(["layers.9"]))
    for budget in (float("inf"), "0.1", 0):
        with pytest.raises(ValueError, match="is not a size"):
            plan(Stack(), x, world_size=2, auto_wrap_policy="auto", memory_budget=budget)
    with pytest.raises(ValueError, match="ignored_modules cannot name its modules"):
        model = Stack()
        plan(model, x, world_size=2, ignored_modules=[model.head])
    with pytest.raises(TypeError, match="qualified module names"):
        ModuleNames([1, 2])
    with pytest.raises(ValueError, match="memory_reserve=1.00 KiB leaves nothing of memory_budget=1.00 KiB"):
        plan(Stack(), x, world_size=2, auto_wrap_policy="auto", memory_budget="1KiB", memory_reserve="1KiB")
    with pytest.raises(ValueError, match="memory_reserve='some' is not a size"):
        plan(Stack(), x, world_size=2, auto_wrap_policy="auto", memory_budget="1GiB", memory_reserve="some")
    with pytest.raises(ValueError, match="memory_budget and memory_reserve are read with auto_wrap_policy='auto'"):
        plan(Stack(), x, world_size=2, memory_reserve="1GiB")
    with pytest.raises(ValueError, match="memory_budget, memory_reserve and example_batch are read"):
        FSDPCustomStrategy(memory_reserve="1GiB")
    with pytest.raises(ValueError, match="chooses cpu_offload and SHARD_GRAD_OP/FULL_SHARD itself"):
        FSDPCustomStrategy(auto_wrap_policy="auto", memory_budget="1GiB", example_batch=x, cpu_offload=True)
    from fsdp_strategy import FSDPCustomFabricStrategy

    with pytest.raises(ValueError, match="in Fabric call fsdp_strategy.plan"):
        FSDPCustomFabricStrategy(auto_wrap_policy="auto")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already has a process group"):
            plan(Stack(), x, world_size=2)
    finally:
        dist.destroy_process_group()
    assert strategy_kwargs({"sharding": "FULL_SHARD", "checkpointing": False, "world": 2}, {Layer})
