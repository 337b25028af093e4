"""A real client, unchanged: LitGPT 0.5.13's own scripts (``litgpt.pretrain``, ``finetune/full``,
``finetune/lora_legacy``, ``finetune/adapter``) called through their ``setup`` entry points with
LitGPT's own arguments, at world 2 and 3 on CPU, with the scripts' ``FSDPStrategy`` swapped for
``FSDPCustomFabricStrategy`` and nothing else changed. The oracle is the same script on Fabric's
DDP: the logged training losses and the final checkpoints (loaded into a plain ``litgpt.GPT``)
are equal. Every run starts from the same checkpoint file (LitGPT's ``initial_checkpoint_dir`` for
pretraining; for LoRA and adapters the file also holds their weights in the base layout, renamed on
load by LitGPT's own ``_load_from_state_dict``), because Fabric's DDP leaves what ``empty_init``
creates uninitialized. LitGPT's random initialization under FSDP (``initialize_weights`` relying on
the strategy to call ``reset_parameters``) is checked against an eager initialization by statistics.

torch.compile (which LitGPT's pretraining calls) is turned off in these ranks for time
(``TORCHDYNAMO_DISABLE=1``: 1 s instead of 25 s a run), except in one compiled pretraining run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from litgpt_client import (
    RandomTokens,
    as_cli,
    logged,
    make_base_checkpoint,
    make_instruction_data,
    strategy_swapped,
    tiny_config,
)
from test_strategy import LIGHTNING_ENV

litgpt = pytest.importorskip("litgpt", reason="LitGPT is a test dependency: pip install --no-deps litgpt==0.5.13")

ENV = {**LIGHTNING_ENV, "TORCHDYNAMO_DISABLE": "1"}
VOCAB = 32


def _train(micro_batch: int, **extra) -> object:
    from litgpt.args import TrainArgs

    return TrainArgs(
        save_interval=None, log_interval=1, global_batch_size=6 * micro_batch, micro_batch_size=micro_batch,
        lr_warmup_steps=1, **extra,
    )  # fmt: skip


def _eval(generate: bool = True) -> object:
    """Validation every 2 steps; finetuning also generates a short example (pretraining refuses that)."""
    from litgpt.args import EvalArgs

    tokens = 2 if generate else None
    return EvalArgs(interval=2, max_iters=2, max_new_tokens=tokens, initial_validation=False, final_validation=True)


def _with_adapter_weights(base: Path, folder: Path, module: str, seed: int) -> Path:
    """A copy of ``base`` whose ``lit_model.pth`` also holds LoRA's or the adapter's weights: the
    base weights under the base layout's keys (``attn.qkv.weight``), LitGPT's own loading maps them."""
    import shutil

    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, folder / name)
    settings = yaml.safe_load((base / "model_config.yaml").read_text())
    if module == "adapter":  # its settings live in the model config (LitGPT's defaults adapt no layer of 2)
        settings.update(_extra_config(module))
    (folder / "model_config.yaml").write_text(yaml.dump(settings))
    family = __import__(f"litgpt.{module}", fromlist=["GPT", "Config"])
    config = family.Config.from_file(
        folder / "model_config.yaml", **(_extra_config(module) if module == "lora" else {})
    )
    torch.manual_seed(seed)
    model = family.GPT(config)
    state = {}
    for key, value in model.state_dict().items():
        for inner in (".linear.weight", ".linear.bias"):
            key = key.replace(inner, inner.removeprefix(".linear"))
        state[key] = value + 0.01 * torch.randn_like(value) if "lora_B" in key or "gating" in key else value
    torch.save(state, folder / "lit_model.pth")
    return folder


def _extra_config(module: str) -> dict:
    if module == "lora":  # lora_legacy.setup's defaults (merge_lora reads them back from the saved hyperparameters)
        return {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_query": True, "lora_value": True}
    return {"adapter_prompt_length": 4, "adapter_start_layer": 0}


def _scripts(root: Path, world: int, ours: bool) -> dict:
    """Every script once, on our strategy or Fabric's DDP; what each logged and saved."""
    import litgpt.finetune.adapter as adapter
    import litgpt.finetune.full as full
    import litgpt.finetune.lora_legacy as lora
    import litgpt.pretrain as pretrain
    from litgpt.data import JSON

    name = "ours" if ours else "ddp"
    base, data = root / "base", root / "data.json"
    out = {}
    with strategy_swapped("litgpt.pretrain", ours), as_cli("pretrain", "pythia-14m"):
        pretrain.setup(
            model_name=None, model_config=tiny_config(VOCAB), out_dir=root / name / "pretrain", precision="32-true",
            initial_checkpoint_dir=base, data=RandomTokens(VOCAB), eval=_eval(generate=False), devices=world,
            train=_train(2, max_tokens=6 * 2 * 16 * 4, max_seq_length=16, min_lr=1e-4, max_norm=1.0),
            logger_name="csv", seed=42,
        )  # fmt: skip
    out["pretrain"] = root / name / "pretrain" / "final" / "lit_model.pth"
    finetunes = [("full", full, base), ("lora", lora, root / "lora_base"), ("adapter", adapter, root / "adapter_base")]
    for script, module, checkpoint in finetunes:
        command = {"full": "finetune_full", "lora": "finetune_lora", "adapter": "finetune_adapter"}[script]
        # LoRA without dropout: materializing the meta-device model draws random numbers (as FSDP's does),
        # Fabric's DDP leaves empty_init's tensors uninitialized and draws none, so dropout masks would differ
        extra = {"lora_dropout": 0.0} if script == "lora" else {}
        argv = [f"--{key}={value}" for key, value in extra.items()]
        with strategy_swapped(module.__name__, ours), as_cli(command, str(checkpoint), *argv):
            module.setup(
                checkpoint_dir=checkpoint, out_dir=root / name / script, precision="32-true", devices=world,
                data=JSON(data, val_split_fraction=0.25, num_workers=0), train=_train(1, epochs=1, max_steps=3),
                eval=_eval(), logger_name="csv", seed=1337, **extra,
            )  # fmt: skip
    out["full"] = root / name / "full" / "final" / "lit_model.pth"
    out["lora"] = root / name / "lora" / "final" / "lit_model.pth.lora"
    out["lora_merged"] = root / name / "lora" / "final" / "lit_model.pth"
    out["adapter"] = root / name / "adapter" / "final" / "lit_model.pth.adapter"
    return {
        "files": {key: str(path) for key, path in out.items()},
        "losses": {script: logged(root / name / script, "loss") for script in ("pretrain", "full", "lora", "adapter")},
    }


def _body(rank: int, world: int, root: str) -> dict:
    folder = Path(root)
    if rank == 0:  # the inputs, as a user has them on disk
        make_base_checkpoint(folder / "base")
        make_instruction_data(folder / "data.json")
        _with_adapter_weights(folder / "base", folder / "lora_base", "lora", seed=3)
        _with_adapter_weights(folder / "base", folder / "adapter_base", "adapter", seed=4)
    torch.distributed.barrier()
    results = {name: _scripts(folder, world, ours) for name, ours in (("ours", True), ("ddp", False))}
    return results if rank == 0 else {}


def _weights(path: str) -> dict[str, torch.Tensor]:
    state = torch.load(path, weights_only=False)  # written by this test; pretraining saves its dataloader
    return state.get("model", state)


def _assert_like_ddp(result: dict) -> None:
    ours, ddp = result["ours"], result["ddp"]
    for script, losses in ddp["losses"].items():
        assert losses and ours["losses"][script] == pytest.approx(losses, rel=1e-5, abs=1e-6), script
    for name, path in ddp["files"].items():
        expected, got = _weights(path), _weights(ours["files"][name])
        assert got.keys() == expected.keys(), name
        worst = max((got[k].float() - expected[k].float()).abs().max().item() for k in expected)
        assert worst < 1e-5, (name, worst)
    config = tiny_config(VOCAB)  # the saved checkpoints load into a plain litgpt.GPT
    for name in ("pretrain", "full", "lora_merged"):
        litgpt.GPT(config).load_state_dict(_weights(ours["files"][name]), strict=True)


@pytest.mark.parametrize("world", [2, 3])
def test_litgpt_scripts_run_unchanged_and_equal_fabric_ddp(tmp_path, world):
    result = run_ranks(_body, world, tmp_path, str(tmp_path), env=ENV, timeout=600)[0]
    _assert_like_ddp(result)


def _init_body(rank: int, world: int, root: str) -> dict:
    """LitGPT's pretraining from a random init (``initialize_weights``; FSDP materializes the meta
    model by ``reset_parameters``), compiled as LitGPT compiles it: one step with a tiny learning rate."""
    import litgpt.pretrain as pretrain

    with strategy_swapped("litgpt.pretrain", True), as_cli("pretrain", "pythia-14m"):
        pretrain.setup(
            model_name=None, model_config=tiny_config(VOCAB), out_dir=Path(root) / "init", precision="32-true",
            data=RandomTokens(VOCAB), train=_train(2, max_tokens=192, max_seq_length=16, min_lr=0.0, max_norm=1.0),
            eval=_eval(generate=False), devices=world, logger_name="csv", seed=42,
            optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-9}},
        )  # fmt: skip
    return {"path": str(Path(root) / "init" / "final" / "lit_model.pth")} if rank == 0 else {}


def test_litgpt_random_init_under_fsdp_is_litgpts_and_compiles(tmp_path):
    env = {key: value for key, value in ENV.items() if key != "TORCHDYNAMO_DISABLE"}
    path = run_ranks(_init_body, 2, tmp_path, str(tmp_path), env=env, timeout=600)[0]["path"]
    from litgpt.pretrain import initialize_weights

    config = tiny_config(VOCAB)
    torch.manual_seed(42)
    eager = litgpt.GPT(config)
    initialize_weights(type("Single", (), {"strategy": None})(), eager, config.n_layer, config.n_embd)
    got = _weights(path)
    for name, value in eager.state_dict().items():
        if value.dim() < 2:
            continue  # norms and biases: constants
        ratio = got[name].float().std().item() / value.float().std().item()
        assert abs(ratio - 1) < 0.15, (name, ratio)  # GPT-NeoX init: std sqrt(2 / 5 / n_embd), proj by layer
