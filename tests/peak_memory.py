"""Peak memory of one consolidation, measured in a fresh process (run by test_checkpoint.py).

    python tests/peak_memory.py SRC DST '{"weights_only": true}'

glibc is told to return big freed blocks to the OS at once (so RSS follows live memory); a
first pass over one tensor loads every lazy import; then the peak (VmHWM) is reset and the
consolidation runs. Prints the peak growth in bytes.
"""

import ctypes
import json
import sys

from fsdp_strategy.checkpoint.consolidation import consolidate, read_tensors, stored_tensors


def status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    src, dst, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    metadata, paths = stored_tensors(__import__("pathlib").Path(src))
    read_tensors(__import__("pathlib").Path(src), metadata, list(paths)[:1])
    from safetensors.torch import save_file  # its first call loads numpy: warm it up outside the measurement

    save_file({"warmup": __import__("torch").zeros(1)}, dst + ".warmup")
    __import__("os").unlink(dst + ".warmup")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    consolidate(src, dst, **options)
    print(status("VmHWM") - base)


if __name__ == "__main__":
    main()
