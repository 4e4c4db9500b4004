"""A runner that speaks `benchmarks.vllm_peer`'s protocol over a fake engine, so the client and
the pipe are tested without vLLM: `python -m tests.unit.benchmarks.fake_vllm_peer`."""

from __future__ import annotations

import sys

from benchmarks.vllm_peer import PeerReady, PeerSetup, Workload, protocol_stdout, serve


class FakeEngine:
    """Answers with the workload's sizes, so a test can tell which workload ran."""

    def __init__(self, setup: PeerSetup) -> None:
        print("a library talking on stdout while it loads")  # must not reach the client
        self.setup = setup

    def describe(self) -> PeerReady:
        return PeerReady("0.0-fake", {"dtype": self.setup.dtype})

    def run(self, workload: Workload) -> dict[str, float]:
        return {"tokens_per_s": float(sum(workload.outputs)), "prompts": len(workload.prompts)}


if __name__ == "__main__":
    serve(FakeEngine, sys.stdin, protocol_stdout())
