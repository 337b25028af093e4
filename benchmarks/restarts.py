"""Ten restarts in a row under plain torchrun, and how long each takes.

    python benchmarks/restarts.py                     # fsdp_custom and ddp, one node and two agents
    python benchmarks/restarts.py --strategies fsdp_custom --layouts one-node --faults 10

One job of tests/restart_job.py (12 steps, ``last`` saved every 2 steps, ``fit(ckpt_path="last")``)
runs under ``torchrun --max-restarts <faults> --rdzv-backend c10d`` with torch's defaults (nothing
in the environment), and SIGKILLs rank 1 ``--faults`` times, at steps 1, 3, 3, 5, 5, ... (each
fault after a resume). ``one-node``: one agent of 2 ranks; ``two-nodes``: two agents of 1 rank each
on this machine. Reported per run: whether the job finished, how many restarts it got through, the
seconds from each fault to the first step trained again (median and worst), and whether its losses
equal an uninterrupted run's (bitwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "restart_job.py")
sys.path.insert(0, str(ROOT / "tests"))
from dist_utils import free_port  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def fault_steps(faults: int) -> list[int]:
    """1, 3, 3, 5, 5, 7, 7, ...: each fault but the first lands after a resume from ``last``."""
    return [1 + 2 * ((n + 1) // 2) for n in range(faults)]


def losses(root: Path) -> dict[tuple[int, int], float]:
    """``(rank, step) -> loss`` of the last attempt that trained each step."""
    found = {}
    for rank in range(2):
        for entry in map(json.loads, (root / "losses" / f"rank{rank}.jsonl").read_text().splitlines()):
            if "loss" in entry:
                found[rank, entry["step"]] = entry["loss"]
    return found


def restart_seconds(root: Path) -> list[float]:
    """Seconds from each fault to the next start of training (rank 0's)."""
    lines = (root / "losses" / "rank0.jsonl").read_text().splitlines()
    starts = [entry["time"] for entry in map(json.loads, lines) if entry.get("event") == "started"]
    faults = sorted(float(path.read_text()) for path in root.glob("fault-*"))
    return [next(start for start in starts if start > fault) - fault for fault in faults if starts[-1] > fault]


def run(strategy: str, layout: str, faults: int, root: Path, timeout: float) -> subprocess.CompletedProcess | None:
    """One job; None if it ran past ``timeout`` (a hang)."""
    endpoint = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "bench"]
    job = [JOB, "--root", str(root), "--strategy", strategy, "--kill-step", *map(str, fault_steps(faults))]
    agents = 1 if layout == "one-node" else 2
    shape = ["--nnodes", str(agents), "--nproc-per-node", str(2 // agents), "--max-restarts", str(faults)]
    processes = [
        subprocess.Popen(
            [*TORCHRUN, *shape, *endpoint, *job], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(agents)
    ]
    deadline = time.monotonic() + timeout
    try:
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in processes]
    except subprocess.TimeoutExpired:
        return None
    finally:
        for process in processes:
            process.kill()
    failed = next((p for p in processes if p.returncode != 0), processes[0])
    return subprocess.CompletedProcess(failed.args, failed.returncode, "\n".join(outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=["fsdp_custom", "ddp"])
    parser.add_argument("--layouts", nargs="+", default=["one-node", "two-nodes"])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a job may take before it counts as hung")
    args = parser.parse_args()
    print("| strategy | layout | finished | restarts done | fault to training again (median, worst) | losses |")
    print("|---|---|---|---|---|---|")
    for strategy in args.strategies:
        with tempfile.TemporaryDirectory() as folder:
            reference = Path(folder, "uninterrupted")
            command = [sys.executable, JOB, "--root", str(reference), "--devices", "2", "--strategy", strategy]
            subprocess.run(command, env=ENV, capture_output=True, check=True)
            for layout in args.layouts:
                root = Path(folder, layout)
                done = run(strategy, layout, args.faults, root, args.timeout)
                finished = "hung" if done is None else "yes" if done.returncode == 0 else f"no (exit {done.returncode})"
                took = restart_seconds(root) if (root / "losses").exists() else []
                timing = f"{statistics.median(took):.1f} s, {max(took):.1f} s" if took else "-"
                same = done is not None and done.returncode == 0 and losses(root) == losses(reference)
                verdict = "equal to uninterrupted" if same else "-"
                print(f"| {strategy} | {layout} | {finished} | {len(took)} of {args.faults} | {timing} | {verdict} |")


if __name__ == "__main__":
    main()
