"""Models created on the meta device are materialized unit by unit: by ``reset_parameters()``,
by a Hugging Face model's own ``_init_weights`` (norms, rotary frequencies, ``Conv1D``), or by
``param_init_fn``; ties survive, nothing stays on meta, and what nothing can initialize is named."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy
from fsdp_strategy.checkpoint import full_state_dict
from fsdp_strategy.engine import get_scheduler, shard_model

transformers = pytest.importorskip("transformers")
LLAMA = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}


class LitLlama(L.LightningModule):
    """A tiny LlamaForCausalLM built from a config (no download) in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = None
        self.losses: list[float] = []
        self.at_start: dict = {}

    def configure_model(self) -> None:
        if self.llama is None:
            self.llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
            self.at_start["created_on_meta"] = all(p.is_meta for p in self.llama.parameters())

    def on_fit_start(self) -> None:
        state = full_state_dict(self, rank0_only=False)
        rotary = self.llama.model.rotary_emb
        expected_freq, _ = rotary.compute_default_rope_parameters(self.llama.config)
        self.at_start.update(
            {
                "norms_are_one": all(torch.all(v == 1) for k, v in state.items() if k.endswith("norm.weight")),
                "inv_freq": torch.allclose(rotary.inv_freq, expected_freq),
                "stats": _statistics({name.removeprefix("llama."): value for name, value in state.items()}),
            }
        )

    def training_step(self, batch, batch_idx):
        loss = self.llama(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _llama_body(rank: int, world: int) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    strategy = FSDPCustomStrategy(auto_wrap_policy={LlamaDecoderLayer})
    trainer = quiet_trainer(strategy=strategy, devices=world, max_steps=8)
    module = LitLlama()
    with trainer.init_module(empty_init=True):
        module.configure_model()
    batch = torch.randint(0, LLAMA["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(TensorDataset(batch.repeat(16, 1)), batch_size=2))
    scheduler = trainer.strategy.scheduler
    return {
        **module.at_start,
        "losses": module.losses,
        "no_meta": not any(t.is_meta for t in [*module.parameters(), *module.buffers()]),
        "units": [u.name for u in scheduler.units],
    }


def test_hugging_face_llama_created_on_meta_trains(tmp_path):
    for result in run_ranks(_llama_body, 2, tmp_path, env=LIGHTNING_ENV, timeout=240):
        assert result["created_on_meta"] and result["no_meta"]
        assert result["norms_are_one"] and result["inv_freq"]  # RMSNorm and rotary: no reset_parameters()
        torch.manual_seed(0)  # every tensor as an eager build's by distribution (initializer_range 0.02, not kaiming)
        eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).state_dict()
        _assert_like_eager(result["stats"], _statistics(eager), "Llama through trainer.init_module(empty_init=True)")
        assert result["units"] == ["root", "llama.model.layers.0", "llama.model.layers.1"]
        assert result["losses"][-1] < result["losses"][0] - 1.0  # it learns the repeated sequence


def _gpt2_body(rank: int, world: int) -> dict:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    shard_model(model, auto_wrap_policy={GPT2Block})
    state = full_state_dict(model, rank0_only=False)
    shards = get_scheduler(model).sharded_params()
    tokens = torch.randint(0, 64, (2, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    return {
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "one_param_for_both": sum(p.fqn == "transformer.wte.weight" for p in shards) == 1
        and len(shards) == len({id(p.sharded) for p in shards}),
        "conv1d_std": state["transformer.h.0.mlp.c_fc.weight"].std().item(),
        "ln_ones": torch.all(state["transformer.h.0.ln_1.weight"] == 1).item(),
        "finite_grads": all(torch.isfinite(p.sharded.grad).all() for p in shards if p.sharded.grad is not None),
    }


def test_gpt2_conv1d_and_tied_head_created_on_meta(tmp_path):
    for result in run_ranks(_gpt2_body, 2, tmp_path):
        assert result["tied"] and result["one_param_for_both"]
        assert 0.015 < result["conv1d_std"] < 0.025 and result["ln_ones"] and result["finite_grads"]


class Gain(nn.Module):
    """No reset_parameters(): a learned gain and rotary-style frequencies computed in __init__."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((dim,), 2.0))
        self.register_buffer("freqs", 1.0 / (10.0 ** torch.arange(dim)), persistent=False)

    def forward(self, x):
        return x * self.gain * self.freqs


class WithGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.gain = Gain()

    def forward(self, x):
        return self.gain(self.linear(x))


def test_modules_nothing_can_initialize_are_named():
    with torch.device("meta"):
        model = WithGain()
    with pytest.raises(ValueError, match=r"\['gain.gain', 'gain.freqs'\].*param_init_fn"):
        shard_model(model)


class IndexMix(nn.Module):
    """A linear layer with an integer permutation and a bool mask made in __init__; its
    reset_parameters() resets the layer and, with ``writes``, the buffers too (in place)."""

    def __init__(self, writes: bool) -> None:
        super().__init__()
        self.writes = writes
        self.lin = nn.Linear(8, 8)
        self.register_buffer("perm", torch.arange(7, -1, -1))
        self.register_buffer("mask", torch.ones(8, dtype=torch.bool))

    def reset_parameters(self) -> None:
        self.lin.reset_parameters()
        if self.writes:
            self.perm.copy_(torch.arange(7, -1, -1))
            self.mask.fill_(True)

    def forward(self, x):
        return self.lin(x[:, self.perm] * self.mask)


def test_integer_and_bool_buffers_nothing_initialized_are_named_not_zeroed():
    with torch.device("meta"):
        model = IndexMix(writes=False)
    with pytest.raises(ValueError, match=r"\['perm', 'mask'\].*param_init_fn"):  # were silently all 0 / False
        shard_model(model)
    with torch.device("meta"):
        model = IndexMix(writes=True)
    shard_model(model)
    assert model.perm.tolist() == list(range(7, -1, -1)) and bool(model.mask.all())


class DataWrites(IndexMix):
    """IndexMix whose reset_parameters() writes the buffers and an int8 parameter through ``.data``
    (which keeps no version): written, not uninitialized."""

    def __init__(self) -> None:
        super().__init__(writes=False)
        self.codes = nn.Parameter(torch.zeros(3, 5, dtype=torch.int8), requires_grad=False)

    def reset_parameters(self) -> None:
        self.lin.reset_parameters()
        self.perm.data.copy_(torch.arange(7, -1, -1))
        self.mask.data.zero_()
        self.codes.data = torch.arange(15, dtype=torch.int8).view(3, 5)


def test_integer_and_bool_tensors_written_through_data_are_initialized():
    with torch.device("meta"):
        model = DataWrites()
    shard_model(model)  # was refused: "cannot initialize ['perm', 'mask', 'codes'] from the meta device"
    assert model.perm.tolist() == list(range(7, -1, -1)) and not bool(model.mask.any())
    assert torch.equal(full_state_dict(model)["codes"], torch.arange(15, dtype=torch.int8).view(3, 5))


class PartWrites(nn.Module):
    """reset_parameters() writes a bool mask in part, a complex buffer's real part only (``half``),
    and nothing to an empty integer cache."""

    def __init__(self, half: bool) -> None:
        super().__init__()
        self.half = half
        self.register_buffer("mask", torch.zeros(5, dtype=torch.bool))
        self.register_buffer("phase", torch.zeros(3, dtype=torch.complex64))
        self.register_buffer("cache", torch.zeros(0, dtype=torch.long))

    def reset_parameters(self) -> None:
        self.mask[:2] = True
        self.phase.real.copy_(torch.arange(3.0))
        if not self.half:
            self.phase.imag.zero_()


def test_meta_init_refuses_half_written_complex_and_leaves_no_invalid_bool():
    with torch.device("meta"):
        model = PartWrites(half=True)
    with pytest.raises(ValueError, match=r"\['phase'\]"):  # its imaginary part was left unwritten
        shard_model(model)
    with torch.device("meta"):
        model = PartWrites(half=False)
    shard_model(model)  # the empty cache needs no initialization
    assert model.mask.tolist() == [True, True, False, False, False]
    assert (~model.mask).tolist() == [False, False, True, True, True]  # no byte a bool cannot hold
    assert torch.equal(model.phase, torch.arange(3.0).to(torch.complex64))


def test_param_init_fn_initializes_what_reset_parameters_cannot():
    def init(module: nn.Module) -> None:
        module.to_empty(device=torch.device("cpu"), recurse=False)
        if isinstance(module, Gain):
            module.gain.fill_(2.0)
            module.freqs.copy_(1.0 / (10.0 ** torch.arange(6)))
        else:
            module.reset_parameters()

    torch.manual_seed(0)
    expected = WithGain()
    with torch.device("meta"):
        model = WithGain()
    shard_model(model, param_init_fn=init)
    assert torch.equal(model.gain.gain, expected.gain.gain) and torch.equal(model.gain.freqs, expected.gain.freqs)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with pytest.raises(TypeError, match="param_init_fn must be a callable"):
        shard_model(WithGain(), param_init_fn="reset")


def _families() -> dict:
    """(model class, config, per-block unit class) of three Hugging Face families, built from configs."""
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    size = {"vocab_size": 96}
    return {
        "llama": (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(**{**LLAMA, **size, "hidden_size": 64, "intermediate_size": 128}),
            LlamaDecoderLayer,
        ),
        "gpt2": (
            transformers.GPT2LMHeadModel,
            transformers.GPT2Config(**size, n_embd=64, n_layer=4, n_head=2, n_positions=32),
            GPT2Block,
        ),
        "bert": (
            transformers.BertForMaskedLM,
            transformers.BertConfig(
                **size,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=128,
                pad_token_id=0,
            ),
            BertLayer,
        ),
    }


def _statistics(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Per floating tensor: constant value (or None), mean, std, element count."""
    result = {}
    for name, value in state.items():
        if not value.is_floating_point() or value.numel() == 0:
            continue
        flat = value.detach().double().reshape(-1)
        constant = flat[0].item() if torch.all(flat == flat[0]) else None
        result[name] = (constant, flat.mean().item(), flat.std().item() if flat.numel() > 1 else 0.0, flat.numel())
    return result


def _meta_family_body(rank: int, world: int) -> dict:
    result = {}
    for family, (model_class, config, block) in _families().items():
        for policy in (None, {block}):
            torch.manual_seed(rank)
            with torch.device("meta"):
                model = model_class(config)
            shard_model(model, auto_wrap_policy=policy)
            state = full_state_dict(model, rank0_only=False)
            padding = None
            if family == "bert":
                padding = state["bert.embeddings.word_embeddings.weight"][config.pad_token_id]
            result[family, policy is not None] = {"stats": _statistics(state), "padding": padding}
    return result


def test_meta_init_reproduces_each_librarys_initialization_by_distribution(tmp_path):
    # eager builds are the reference: every constant (norms, biases, the padding row) exactly; every
    # random tensor's std within 10 % (or 4 standard errors) of the eager one and its mean within 4
    # standard errors; GPT-2's c_proj rescaled by its parent module (std 0.02 / sqrt(2 * n_layer)),
    # which a child-only init misses
    results = run_ranks(_meta_family_body, 2, tmp_path, timeout=300)[0]
    for family, (model_class, config, _) in _families().items():
        torch.manual_seed(0)
        eager = _statistics(model_class(config).state_dict())
        for per_block in (False, True):
            got = results[family, per_block]["stats"]
            _assert_like_eager(got, eager, f"{family} ({'per-block units' if per_block else 'one unit'})")
            if family == "gpt2":
                c_proj = got["transformer.h.0.attn.c_proj.weight"][2]
                assert abs(c_proj / (0.02 / (2 * config.n_layer) ** 0.5) - 1) < 0.1, c_proj
            if family == "bert":
                assert torch.all(results[family, per_block]["padding"] == 0), family


def _assert_like_eager(got: dict[str, tuple], eager: dict[str, tuple], what: str) -> None:
    """Every constant (norms, biases) exactly as the eager build's; every random tensor's std within 10 %
    (or 4 standard errors) of the eager one and its mean within 4 standard errors."""
    assert got.keys() == eager.keys(), (what, sorted(got.keys() ^ eager.keys()))
    for name, (constant, mean, std, count) in eager.items():
        g_constant, g_mean, g_std, _ = got[name]
        if constant is not None:
            assert g_constant == constant, f"{what} {name}: {got[name]} vs constant {constant}"
            continue
        tolerance = max(0.1, 4 / (2 * count) ** 0.5)  # 4 standard errors of a sample std
        assert abs(g_std / std - 1) < tolerance, f"{what} {name}: std {g_std:.5f} vs eager {std:.5f}"
        assert abs(g_mean - mean) < 4 * std / count**0.5 + 1e-6, f"{what} {name}: mean {g_mean} vs {mean}"
