"""The GPT example through LightningCLI: the strategy and its arguments from YAML or flags.

python examples/cli.py fit --config examples/configs/cli.yaml
python examples/cli.py fit --config examples/configs/cli.yaml --trainer.max_steps 20
python examples/cli.py fit --config examples/configs/cli.yaml \
    --trainer.strategy.init_args.sharding_strategy SHARD_GRAD_OP

``--trainer.strategy NAME`` would replace the whole strategy block of the YAML (wrap policy and
checkpoint type included): change one argument with ``--trainer.strategy.init_args.ARG``.
``trainer.max_steps`` also sets the model's LR schedule length and ``data.batch_size`` the
batch its FLOP count is measured for, so each is given once.
"""

import os
import sys

import noise
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lit_gpt import ByteDataModule, GPTModule

import fsdp_strategy  # noqa: F401 - registers "fsdp_custom" and its variants with Lightning


class GPTCLI(LightningCLI):
    """LightningCLI with the values the model and the trainer share linked."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("trainer.max_steps", "model.max_steps")
        parser.link_arguments("data.batch_size", "model.batch_size")

    def before_instantiate_classes(self) -> None:
        """An offline W&B logger prints nothing worth reading (as in train_gpt.py): silence it."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        init_args = getattr(config.get("trainer.logger"), "init_args", None)
        if init_args is not None and init_args.get("offline"):
            os.environ.setdefault("WANDB_SILENT", "true")

    def instantiate_classes(self) -> None:
        """Lightning's, but a class that refuses its arguments (a typo in a wrap-policy class path)
        ends the script with that reason first and alone, not under jsonargparse's traceback."""
        try:
            super().instantiate_classes()
        except ValueError as error:
            reasons = [_reason(line) for line in str(error).splitlines() if _reason(line)]
            if not reasons:
                raise
            sys.exit(f"cli.py: error: {'; '.join(reasons)}")
        for logger in self.trainer.loggers:  # before its run starts, as in train_gpt.py
            noise.without_unused_wandb_settings(logger)


def _reason(line: str) -> str:
    """A reason jsonargparse lists under "Errors:" ("  - ..."), other than its own type mismatches."""
    text = line.strip()
    return text[2:] if text.startswith("- ") and not text.startswith("- Expected a ") else ""


def main() -> None:
    noise.quiet_known_noise()
    GPTCLI(GPTModule, ByteDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
