"""The GPT example through LightningCLI: the strategy and its arguments from YAML or flags.

python examples/cli.py fit --config examples/configs/cli.yaml
python examples/cli.py fit --config examples/configs/cli.yaml --trainer.strategy fsdp_custom
python examples/cli.py fit --config examples/configs/cli.yaml --trainer.max_steps 20
"""

from lightning.pytorch.cli import LightningCLI
from lit_gpt import ByteDataModule, GPTModule

import fsdp_strategy  # noqa: F401 - registers "fsdp_custom" and its variants with Lightning


def main() -> None:
    LightningCLI(GPTModule, ByteDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
