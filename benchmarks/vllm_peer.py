"""vLLM's CPU build as a peer of `benchmarks.engine`: the client the benchmark drives, and the
runner that `.peers/vllm/bin/python -m benchmarks.vllm_peer` serves (`scripts/peers vllm`).

vLLM is never a dependency of the project: only the runner, under the peer virtualenv's python,
imports it. The pipe carries JSON lines: the client sends one `PeerSetup` (model, settings and
every workload), the runner loads `vllm.LLM` once and answers `PeerReady`, then one result per
`RunWorkload` line, so reps interleave with Sluice's without reloading vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from benchmarks.stats import run_figures

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".peers" / "vllm" / "bin" / "python"
INSTALL_HINT = "run scripts/peers vllm"


@dataclass(frozen=True, slots=True)
class Workload:
    """Token-id prompts and exact output lengths (EOS ignored), as Sluice runs them.
    `kind`: "mixed" (all at once: tokens/s and median TTFT) or "batch1" (one prompt:
    decode tokens/s after the first token, and TTFT)."""

    kind: str
    prompts: list[list[int]]
    outputs: list[int]


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """The first line to the runner. `threads_bind` and `kvcache_space_gib` become
    VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_KVCACHE_SPACE in the runner's environment."""

    model: str
    dtype: str
    threads_bind: str
    kvcache_space_gib: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    workloads: dict[str, Workload] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> PeerSetup:
        raw = json.loads(line)
        raw["workloads"] = {k: Workload(**w) for k, w in raw.get("workloads", {}).items()}
        return cls(**raw)


@dataclass(frozen=True, slots=True)
class RunWorkload:
    """Run the setup's workload `name` once; the runner answers one result line."""

    name: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> RunWorkload:
        return cls(**json.loads(line))


@dataclass(frozen=True, slots=True)
class PeerReady:
    """The runner's answer once the model is loaded: what ran, for the result JSON."""

    version: str
    settings: dict[str, Any]


class PeerError(RuntimeError):
    """The runner failed or answered an error; the message carries its stderr's tail."""


class PeerEngine(Protocol):
    def describe(self) -> PeerReady: ...

    def run(self, workload: Workload) -> dict[str, float]: ...


def serve(load: Callable[[PeerSetup], PeerEngine], inp: Iterable[str], out: IO[str]) -> None:
    """The runner's loop: setup line, ready line, then one answer per command line. A bad
    command is answered with `{"error": ...}`; the runner stays up for the next."""
    lines = iter(inp)
    setup = PeerSetup.from_json(next(lines))
    engine = load(setup)
    _send(out, {"ready": asdict(engine.describe())})
    for line in lines:
        if not line.strip():
            continue
        try:
            cmd = RunWorkload.from_json(line)
            workload = setup.workloads[cmd.name]
        except (ValueError, TypeError, KeyError) as e:
            _send(out, {"error": f"bad command {line.strip()!r}: {e!r}"})
            continue
        _send(out, engine.run(workload))


def _send(out: IO[str], msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


class VllmPeer:
    """The client: starts the runner, sends the setup, and runs workloads by name.

    `command`: how to start the runner (default: the peer venv's python on this module);
    the runner's stderr (vLLM's logs) goes to a temporary file, quoted on failure.
    `settle_s`: idle after loading and after each answer, since vLLM's worker busy-polls
    for about a second after its last request and would slow whatever runs next."""

    def __init__(
        self, setup: PeerSetup, command: list[str] | None = None, settle_s: float = 3.0
    ) -> None:
        self.settle_s = settle_s
        self._ready: PeerReady | None = None
        # held open as long as the runner lives, closed by close()
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        env = dict(os.environ)
        env.update(peer_environment(setup))
        self._proc = subprocess.Popen(
            command or [str(PEER_PYTHON), "-m", "benchmarks.vllm_peer"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._write(setup.to_json())  # the runner loads meanwhile; wait_ready() waits

    def wait_ready(self) -> PeerReady:
        """Block until the runner has loaded the model (at once after the first time)."""
        if self._ready is None:
            msg = self._read()
            if "ready" not in msg:
                raise self._error(f"expected a ready line, got {msg!r}")
            self._ready = PeerReady(**msg["ready"])
            time.sleep(self.settle_s)
        return self._ready

    def run(self, name: str) -> dict[str, float]:
        self.wait_ready()
        self._write(RunWorkload(name).to_json())
        msg = self._read()
        time.sleep(self.settle_s)
        if "error" in msg:
            raise self._error(msg["error"])
        return msg

    def close(self) -> None:
        if self._proc.stdin:
            # the runner's loop ends at end of input; a pipe already broken means it exited
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, line: str) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError as e:
            raise self._error(f"the runner exited (rc={self._proc.wait()})") from e

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise self._error(f"the runner exited (rc={self._proc.wait()})")
        msg: dict[str, Any] = json.loads(line)
        return msg

    def _error(self, what: str) -> PeerError:
        self._log.seek(0)
        tail = self._log.read()[-3000:]
        return PeerError(f"vLLM peer: {what}\n--- its stderr (tail) ---\n{tail}")


def peer_environment(setup: PeerSetup) -> dict[str, str]:
    return {
        "VLLM_CPU_OMP_THREADS_BIND": setup.threads_bind,
        "VLLM_CPU_KVCACHE_SPACE": str(setup.kvcache_space_gib),
    }


def threads_bind(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND
    takes them ("0,1"): vLLM's "auto" keeps a core back for its front end."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(str(c) for c in cpus)


def available() -> bool:
    return PEER_PYTHON.exists()


class _Vllm:
    """`vllm.LLM` behind `PeerEngine`; only the peer venv's python builds one."""

    def __init__(self, setup: PeerSetup) -> None:
        from vllm import LLM

        self.setup = setup
        self.llm = LLM(
            model=setup.model,
            dtype=setup.dtype,
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=setup.max_model_len,
            seed=0,
        )
        self._next_id = 0

    def describe(self) -> PeerReady:
        import importlib.metadata

        import torch

        settings: dict[str, Any] = {
            k: v for k, v in asdict(self.setup).items() if k not in ("model", "workloads")
        }
        settings |= {k: os.environ.get(k) for k in peer_environment(self.setup)}
        settings["torch"] = torch.__version__
        settings["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get(
            "VLLM_ENABLE_V1_MULTIPROCESSING", "1"
        )
        return PeerReady(importlib.metadata.version("vllm-cpu"), settings)

    def run(self, workload: Workload) -> dict[str, float]:
        if workload.kind == "batch1":
            prompt, new = workload.prompts[0], workload.outputs[0]
            self._generate([prompt], [4])  # warm-up, as Sluice's batch-1 rep has
            ttft = self._generate([prompt], [1])["elapsed_s"]
            total = self._generate([prompt], [new])["elapsed_s"]
            return {"tokens_per_s": (new - 1) / max(total - ttft, 1e-9), "ttft_ms": ttft * 1e3}
        self.llm.reset_prefix_cache()  # each rep cold, as Sluice's
        res = self._generate(workload.prompts, workload.outputs)
        return {k: v for k, v in res.items() if k != "elapsed_s"}

    def _generate(self, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
        """`LLM.generate`'s own loop over the engine, timing each request's first token."""
        from vllm import SamplingParams, TokensPrompt

        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        for p, n in zip(prompts, outputs, strict=True):
            params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
            engine.add_request(f"r{self._next_id}", TokensPrompt(prompt_token_ids=p), params)
            self._next_id += 1
        first: dict[str, float] = {}
        generated = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    first.setdefault(out.request_id, time.perf_counter() - t0)
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
        return run_figures(generated, time.perf_counter() - t0, first.values())


def protocol_stdout() -> IO[str]:
    """The real stdout, for the protocol alone; from here on anything the process or its
    children print (vLLM logs to stdout) goes to stderr."""
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return proto


def main() -> None:
    serve(_Vllm, sys.stdin, protocol_stdout())


if __name__ == "__main__":
    main()
