"""`python -m benchmarks.kernels`: the decode kernels' work sharing on a CPU that is busy.

With a busy process on every core, a bf16 GEMV shared by 2 threads should take about as
long as on 1: the calling thread never waits for a helper that is off its core (an OpenMP
barrier waited out a scheduler slice per call, 30x slower). Exits 1 when the 2-thread
call is over `MAX_RATIO` times slower (a shared call may lose a few slices to the
scheduler, not one per call). Moved out of the unit tests: it asserted wall-clock time.

    .venv/bin/python -m benchmarks.kernels [--calls 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from sluice.engine import kernels

MAX_RATIO = 4.0
_BUSY = "import time\nt = time.time() + {s}\nwhile time.time() < t: pass\n"


def per_call_s(ops: kernels.CpuOps, threads: int, calls: int) -> float:
    """Mean seconds per 2816x512 bf16 GEMV (one row) at `threads` torch threads."""
    w = torch.randn(2816, 512).to(torch.bfloat16)
    x = torch.randn(1, 512)
    torch.set_num_threads(threads)
    ops.bf16_linear(x, w, None)
    t = time.perf_counter()
    for _ in range(calls):
        ops.bf16_linear(x, w, None)
    return (time.perf_counter() - t) / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ops = kernels.cpu_ops()
    if ops is None:
        print("no CPU kernels here (no AVX2/FMA or no C compiler)", file=sys.stderr)
        return 2
    n = os.cpu_count() or 2
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY.format(s=20)]) for _ in range(n)]
    before = torch.get_num_threads()
    try:
        time.sleep(0.2)  # let the busy processes take their cores
        one, two = per_call_s(ops, 1, args.calls), per_call_s(ops, 2, args.calls)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        torch.set_num_threads(before)
    ratio = two / one
    if args.json:
        print(json.dumps({"busy_processes": n, "one_thread_us": one * 1e6,
                          "two_threads_us": two * 1e6, "ratio": ratio}))  # fmt: skip
    else:
        print(f"{n} busy processes: 1 thread {one * 1e6:.0f} µs/call, 2 threads "
              f"{two * 1e6:.0f} µs/call ({ratio:.2f}x, at most {MAX_RATIO}x)")  # fmt: skip
    return 0 if two < MAX_RATIO * one + 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
