"""`python -m benchmarks` (what `sluice bench` runs): the benchmark commands."""

from benchmarks.cli import bench_app

bench_app(prog_name="sluice bench")
