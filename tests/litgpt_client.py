"""LitGPT as a client, for tests/test_litgpt.py: a tiny base checkpoint folder (config, weights and a
tokenizer made here, no download), instruction data and random pretraining tokens, and the one
change a LitGPT user makes: the scripts' ``FSDPStrategy`` swapped for ``FSDPCustomFabricStrategy``
(or, for the oracle, for Fabric's DDP). Everything else is LitGPT's own code, called through its
scripts' entry points (``setup``) with LitGPT's own arguments.
"""

from __future__ import annotations

import csv
import importlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from torch.utils.data import DataLoader

WORDS = (
    "the a model learns to add one two three four five six seven eight nine ten and of is it in on at by as "
    "for so we up"
).split()  # with SPECIAL: a vocabulary of 32
SPECIAL = ["<unk>", "<s>", "</s>"]


def tiny_config(vocab: int) -> Any:
    """A two-layer LitGPT model small enough for a CPU test."""
    from litgpt import Config

    return Config(
        name="tiny-test",
        block_size=64,
        vocab_size=vocab,
        padded_vocab_size=vocab,
        n_layer=2,
        n_head=2,
        n_embd=16,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=True,
    )


def make_tokenizer(folder: Path) -> int:
    """A word-level tokenizer (``tokenizer.json`` and ``tokenizer_config.json``); returns its vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate([*SPECIAL, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "tokenizer_class": "Tokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


def make_base_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A LitGPT checkpoint folder as ``litgpt download`` leaves it: config, ``lit_model.pth`` of a
    plain ``litgpt.GPT``, tokenizer files."""
    from litgpt import GPT
    from litgpt.utils import save_config

    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(make_tokenizer(folder))
    save_config(config, folder)
    torch.manual_seed(seed)
    torch.save(GPT(config).state_dict(), folder / "lit_model.pth")
    return folder


def make_instruction_data(path: Path, samples: int = 24) -> Path:
    """Instruction data in the JSON layout of ``litgpt.data.JSON``."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(samples):
        a, b = (int(x) for x in torch.randint(1, 5, (2,), generator=generator))
        rows.append({"instruction": f"add {WORDS[5 + a]} and {WORDS[5 + b]}", "input": "", "output": WORDS[5 + a + b]})
    path.write_text(json.dumps(rows))
    return path


class RandomTokens:
    """A ``litgpt.data.DataModule`` of random token sequences (what pretraining reads), no tokenizer."""

    def __new__(cls, vocab: int, samples: int = 64) -> Any:
        from litgpt.data import DataModule

        class _RandomTokens(DataModule):
            def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
                self.batch_size, self.length = batch_size, (max_seq_length or 16) + 1

            def train_dataloader(self) -> DataLoader:
                generator = torch.Generator().manual_seed(1)
                data = torch.randint(0, vocab, (samples, self.length), generator=generator)
                return DataLoader(data, batch_size=self.batch_size)

            def val_dataloader(self) -> DataLoader:
                generator = torch.Generator().manual_seed(2)
                return DataLoader(torch.randint(0, vocab, (8, self.length), generator=generator), batch_size=2)

        return _RandomTokens()


class _DDPInstead:
    """Stands in for ``FSDPStrategy(...)`` in a script and gives Fabric's DDP (the oracle); it is not
    an ``FSDPStrategy``, so the script takes its non-FSDP branches, as it does on one device."""

    def __new__(cls, **kwargs: Any) -> DDPStrategy:
        return DDPStrategy(find_unused_parameters=True)


@contextmanager
def as_cli(*argv: str) -> Iterator[None]:
    """``sys.argv`` as LitGPT's command line has it while a script runs: LitGPT saves the
    hyperparameters by parsing it (``save_hyperparameters``), as ``litgpt finetune_lora ...`` gives it."""
    import sys

    saved = sys.argv
    sys.argv = ["litgpt", *argv]
    try:
        yield
    finally:
        sys.argv = saved


@contextmanager
def strategy_swapped(script: str, ours: bool) -> Iterator[None]:
    """The one edit a user makes to a LitGPT script: its ``FSDPStrategy`` is ours (or DDP's)."""
    from fsdp_strategy import FSDPCustomFabricStrategy

    module = importlib.import_module(script)
    original = module.FSDPStrategy
    module.FSDPStrategy = FSDPCustomFabricStrategy if ours else _DDPInstead
    try:
        yield
    finally:
        module.FSDPStrategy = original


def logged(out_dir: Path, column: str) -> list[float]:
    """A column of the CSV logger's metrics (rank 0's), in order."""
    files = sorted(Path(out_dir).glob("logs/csv/version_*/metrics.csv"))
    assert files, f"no metrics under {out_dir}"
    with files[-1].open() as handle:
        return [float(row[column]) for row in csv.DictReader(handle) if row.get(column)]
