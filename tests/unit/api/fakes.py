"""Fakes for the gateway tests: a byte-level tokenizer and a scripted engine worker.

`FakeEngineWorker` is a real implementation of the engine side of the wire protocol
(not a mock): it consumes the lane topics and the control topic from the bus, and
answers on `reply_topic(request.reply_to)` with one `TokenDeltaBatch` per step, one
token per request per step, seq_no in order, offsets absolute, usage on the terminal
delta, and an `abort` terminal when a Cancel arrives.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from llguidance import LLMatcher

from sluice.api.served import ServedModel
from sluice.bus.base import EventBus
from sluice.bus.codec import decode, encode
from sluice.bus.messages import (
    Cancel,
    FinishReason,
    GenerateRequest,
    PromptLogprob,
    TokenDelta,
    TokenDeltaBatch,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from sluice.bus.topics import CONTROL_TOPIC, reply_topic, request_topics
from sluice.engine.sampling import Constraint
from sluice.engine.structured import grammar_for
from tests.waiting import wait_until


class ByteTokenizer:
    """One token per UTF-8 byte; chat template `<role>content\\n...<assistant>`."""

    eos_token_ids: tuple[int, ...] = (0,)
    vocab_size: int = 256
    max_token_chars: int = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode(errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


def check_grammar_alone(kind: str, value: str) -> None:
    """The engine's grammar for a constraint, validated without a vocabulary (the byte
    tokenizer has no Hugging Face tokenizer for llguidance to read)."""
    error = LLMatcher.validate_grammar(grammar_for(Constraint(kind, value)))
    if error:
        raise ValueError(error)


def served_model(name: str = "tiny", max_model_len: int = 256) -> ServedModel:
    return ServedModel(
        name=name,
        max_model_len=max_model_len,
        tokenizer=ByteTokenizer(),
        check_constraint=check_grammar_alone,
    )


@dataclass
class _Active:
    request: GenerateRequest
    reply: str
    pos: int = 0
    seq_no: int = 0


def _prompt_logprobs(req: GenerateRequest) -> list[PromptLogprob | None]:
    """Every prompt token after the first at -1.0, rank 1, itself its top alternative."""
    k = req.sampling.prompt_logprobs or 0
    return [None] + [
        PromptLogprob(
            token_id=t, logprob=-1.0, rank=1, top=[TopLogprob(token_id=t, logprob=-1.0)][:k]
        )
        for t in req.prompt_token_ids[1:]
    ]


@dataclass
class FakeEngineWorker:
    """Modes: "echo" answers `reply` (cut at max_tokens → "length"; prompt logprobs on
    the first delta when asked, `_prompt_logprobs`); "hang" answers
    nothing until cancelled; "error" fails after 2 tokens; "deadline" ends with
    finish_reason deadline after 2 tokens."""

    bus: EventBus
    reply: str = "Hello world"
    mode: str = "echo"
    step_s: float = 0.002
    group_id: str = "fake-engine"
    # the model pools whose lanes it reads (`pool_id` of the gateway's served models)
    pools: tuple[str, ...] = ("tiny",)
    requests: list[tuple[str, GenerateRequest]] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._active: dict[str, _Active] = {}
        self._targets: dict[str, str] = {}  # request_id -> reply_to
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._ready = threading.Event()

    def start(self) -> FakeEngineWorker:
        self._thread.start()
        assert self._ready.wait(30), "fake engine never joined its group"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def wait_for_requests(self, n: int, timeout_s: float = 5.0) -> list[GenerateRequest]:
        wait_until(lambda: len(self.requests) >= n, timeout_s, f"{n} requests at the engine")
        return [r for _, r in self.requests]

    def wait_for_cancels(self, n: int, timeout_s: float = 5.0) -> list[Cancel]:
        wait_until(lambda: len(self.cancels) >= n, timeout_s, f"{n} cancels at the engine")
        return list(self.cancels)

    def _run(self) -> None:
        lanes = [topic for pool in self.pools for topic in request_topics(pool)]
        consumer = self.bus.consumer(self.group_id, [*lanes, CONTROL_TOPIC], offset_reset="latest")
        try:
            while not self._stop.is_set():
                was_assigned = bool(consumer.assignment())
                records = consumer.poll(0.01)
                if was_assigned:  # "latest" positions resolve in the poll after assignment
                    self._ready.set()
                for record in records:
                    message = decode(record.topic, record.value)
                    if isinstance(message, GenerateRequest):
                        self.requests.append((record.topic, message))
                        self._active[message.request_id] = _Active(message, self.reply)
                        self._targets[message.request_id] = message.reply_to
                    elif isinstance(message, Cancel):
                        ids = [message.request_id] if message.request_id else [
                            rid for rid, a in self._active.items()
                            if a.request.batch_id == message.batch_id
                        ]  # fmt: skip
                        for request_id in ids:
                            active = self._active.pop(request_id or "", None)
                            if active is not None:
                                self._publish([self._terminal(active, "abort")])
                        self.cancels.append(message)
                self._step()
                time.sleep(self.step_s)
        finally:
            consumer.close()

    def _terminal(self, a: _Active, reason: FinishReason, error: str | None = None) -> TokenDelta:
        delta = TokenDelta(
            request_id=a.request.request_id,
            attempt=a.request.attempt,
            seq_no=a.seq_no,
            token_offset=a.pos,
            text_offset=a.pos,
            finish_reason=reason,
            error=error,
            usage=Usage(prompt_tokens=len(a.request.prompt_token_ids), completion_tokens=a.pos),
        )
        a.seq_no += 1
        return delta

    def _step(self) -> None:
        if self.mode == "hang":
            return
        out: list[TokenDelta] = []
        for request_id, a in list(self._active.items()):
            req = a.request
            limit = min(len(a.reply), req.sampling.max_tokens)
            if self.mode in ("error", "deadline") and a.pos >= 2:
                reason: FinishReason = "error" if self.mode == "error" else "deadline"
                out.append(self._terminal(a, reason, "boom" if reason == "error" else None))
                del self._active[request_id]
                continue
            char = a.reply[a.pos]
            logprobs = None
            if req.sampling.logprobs is not None:
                top = [TopLogprob(token_id=ord(char), logprob=-0.5)][: req.sampling.logprobs]
                logprobs = [TokenLogprob(token_id=ord(char), logprob=-0.5, top=top)]
            delta = dict(
                request_id=request_id,
                attempt=req.attempt,
                seq_no=a.seq_no,
                token_offset=a.pos,
                text_offset=a.pos,
                token_ids=[ord(char)],
                text=char,
                logprobs=logprobs,
            )
            if a.pos == 0 and req.sampling.prompt_logprobs is not None:
                delta["prompt_logprobs"] = _prompt_logprobs(req)
            a.pos += 1
            a.seq_no += 1
            if a.pos >= limit:
                reason = "length" if limit < len(a.reply) else "stop"
                usage = Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=a.pos)
                out.append(TokenDelta(**delta, finish_reason=reason, usage=usage))  # type: ignore[arg-type]
                del self._active[request_id]
            else:
                out.append(TokenDelta(**delta))  # type: ignore[arg-type]
        if out:
            self._publish(out)

    def _publish(self, deltas: list[TokenDelta]) -> None:
        by_target: dict[str, list[TokenDelta]] = {}
        for d in deltas:
            by_target.setdefault(self._targets[d.request_id], []).append(d)
        for reply_to, group in by_target.items():
            batch = TokenDeltaBatch(reply_to=reply_to, deltas=group)
            self.bus.publish(reply_topic(reply_to), encode(batch), key=reply_to.encode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """uvicorn serving `app` on a loopback port, in a thread (for real clients)."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", ws="websockets-sansio"
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn to start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(10)
