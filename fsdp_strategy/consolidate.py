"""``fsdp-consolidate SRC DST``: a sharded checkpoint folder to one file, no process group needed.

fsdp-consolidate runs/ckpt/last.ckpt model.pt --weights-only --dtype bf16
fsdp-consolidate runs/ckpt/last.ckpt gpt.pt --weights-only --strip-prefix model.
python -m fsdp_strategy.consolidate runs/ckpt/last.ckpt out --format safetensors --max-shard-size 2GB
"""

from __future__ import annotations

import argparse
import re
import sys

from fsdp_strategy import __version__
from fsdp_strategy.checkpoint.consolidation import FORMATS, consolidate

_SWITCHES = {"weights_only=True": "--weights-only", "overwrite=True": "--overwrite"}
_OPTIONS = {"output_format": "--format", "max_shard_size": "--max-shard-size", "strip_prefix": "--strip-prefix"}


def in_flags(message: str) -> str:
    """``consolidate()``'s message with its Python arguments named as this command's flags
    (``overwrite=True`` -> ``--overwrite``, ``max_shard_size='2'`` -> ``--max-shard-size='2'``)."""
    for argument, flag in _SWITCHES.items():
        message = message.replace(argument, flag)
    message = message.replace("output_format='safetensors'", "--format=safetensors")
    names = "|".join([*_OPTIONS, "dtype"])
    named = rf"(?:^|(?<=\s))({names})(?==|\s)"  # an argument given a value, or a message's subject
    return re.sub(named, lambda found: _OPTIONS.get(found[1], "--" + found[1]), message)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and consolidate; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="fsdp-consolidate",
        description="Turn a sharded checkpoint folder into one file (or safetensors shards); no process group needed.",
        epilog="examples:\n"
        "  fsdp-consolidate runs/ckpt/last.ckpt model.pt --weights-only --dtype bf16\n"
        "  fsdp-consolidate runs/ckpt/last.ckpt out --format safetensors --max-shard-size 2GB",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", help="a sharded checkpoint folder (written with state_dict_type='sharded')")
    parser.add_argument("dst", help="the output file (a folder with --max-shard-size); its parent folder must exist")
    parser.add_argument("--weights-only", action="store_true", help="write only the model's state dict")
    parser.add_argument("--dtype", default=None, help="cast floating tensors: bf16, fp16 or fp32")
    parser.add_argument("--format", default="torch", choices=FORMATS, help="torch (default) or safetensors")
    parser.add_argument(
        "--max-shard-size", default=None, metavar="SIZE", help="safetensors: files of at most SIZE, e.g. 500MB, 2GB"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--strip-prefix",
        default=None,
        metavar="PREFIX",
        help="with --weights-only or safetensors: drop PREFIX (the LightningModule's attribute, e.g. 'model.') "
        "from every key, for inner_module.load_state_dict(torch.load(DST))",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    args = parser.parse_args(argv)
    try:
        out = consolidate(
            args.src,
            args.dst,
            weights_only=args.weights_only,
            dtype=args.dtype,
            output_format=args.format,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            strip_prefix=args.strip_prefix,
        )
    except (OSError, ValueError) as error:
        print(f"fsdp-consolidate: error: {in_flags(str(error))}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
