"""Logits processing before the draw: min_tokens, logit_bias, penalties, the grammar mask.

`ModelRunner.execute` hands the fp32 logits of a step's rows here when any of them asks
for processing (`SamplingParams.processes_logits`); steps without such rows never come
here. The order and formulas are vLLM's: min_tokens sets EOS (unless ignore_eos) and
stop_token_ids to -inf while the request has fewer outputs; logit_bias is added; the
repetition penalty divides positive logits (multiplies the others) of tokens in the prompt
or the output; the frequency penalty subtracts penalty * count in the output, the presence
penalty penalty * [in the output]; then tokens the grammar forbids go to -inf. Every step
before the grammar keeps -inf at -inf, so where the grammar mask goes in the order does not
change the result. A resumed attempt's resumed tokens are output here, as they were for
the attempt that made them. The grammar wins over min_tokens: a row whose grammar allows
nothing but a stop token keeps it.

A constrained request winding up (its last quarter of max_tokens, at least `WRAP_UP_MIN`
tokens, or while its last outputs repeat: `looping`) is steered to the end of its output,
one allowed token at a time: inside a JSON string the first of `STRING_ENDS` the grammar
allows (what ends a string, an email, a date-time, a pattern soonest), elsewhere the
first of `STRUCTURE_ENDS` (close objects and arrays, go on to what is required); when
none is allowed, a token of its last `WRAP_UP_WINDOW` outputs only if nothing else is. A
token its last `LOOP_REPEATS` outputs all were is never taken again while another is
allowed. A weak model looping in a free string, an open array or a number would
otherwise be cut at max_tokens with output that does not parse; this way it ends valid.
A model that does not loop and ends within three quarters of max_tokens is never steered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from sluice.engine.core.request import Request
from sluice.engine.structured import RequestMatcher

NEG_INF = float("-inf")
WRAP_UP_MIN = 32  # tokens: the least a constrained request keeps for closing its JSON
LOOP_WINDOW = 12  # recent outputs that, repeating with a period of at most LOOP_PERIOD,
LOOP_PERIOD = 4  # are a loop: the request winds up until it is out of it
WRAP_UP_WINDOW = 16  # recent outputs a winding-up request does not repeat
LOOP_REPEATS = 4  # the same token this many times in a row is a loop
# inside a string: what ends a string, an email, a date-time, a pattern soonest ("1": a
# year, month or day of 0 is not a date to every reader)
STRING_ENDS = '"@.Z1a'
# elsewhere: close objects and arrays, go on to what is required, null a nullable value
# (a recursion ends there), a value as short as any
STRUCTURE_ENDS = '}],n"1'


def winding_up(request: Request) -> bool:
    """Whether a constrained request winds up: in its last quarter of max_tokens (counted
    from the first attempt's, so a resumed attempt winds up at the same token), or while
    its recent outputs repeat (" gate gate gate ...")."""
    params = request.sampling_params
    left = params.max_tokens - len(request.output_token_ids)
    budget = params.max_tokens + request.num_resumed_tokens
    return left <= max(WRAP_UP_MIN, budget // 4) or looping(output_token_ids(request))


def looping(tokens: Sequence[int]) -> bool:
    """Whether the last `LOOP_WINDOW` tokens repeat with a period of at most `LOOP_PERIOD`."""
    if len(tokens) < LOOP_WINDOW:
        return False
    tail = tokens[-LOOP_WINDOW:]
    return any(
        all(tail[i] == tail[i - p] for i in range(p, LOOP_WINDOW))
        for p in range(1, LOOP_PERIOD + 1)
    )


def output_token_ids(request: Request) -> list[int]:
    """The tokens penalties and grammars count as output: an earlier attempt's (resumed,
    the prompt's tail) and this attempt's."""
    resumed = request.num_resumed_tokens
    if not resumed:
        return request.output_token_ids
    return request.prompt_token_ids[-resumed:] + request.output_token_ids


def grammar_allowed(matchers: Sequence[RequestMatcher], mask_words: int, vocab: int) -> np.ndarray:
    """[len(matchers), vocab] bool: the tokens each grammar allows next. numpy, as is the
    mask's use: a torch op here would wake torch's thread pool, whose spinning helpers
    slow the fused decode kernels of the next step."""
    words = np.zeros((len(matchers), mask_words), dtype=np.int32)
    for row, matcher in zip(words, matchers, strict=True):
        matcher.fill_mask(row)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return bits.view(np.bool_)


def _wind_up(allowed: np.ndarray, matcher: RequestMatcher, request: Request) -> np.ndarray:
    """The tokens a winding-up request may take next, a subset of `allowed`."""
    vocab = allowed.shape[0]
    recent = [t for t in output_token_ids(request)[-WRAP_UP_WINDOW:] if t < vocab]
    tail = recent[-LOOP_REPEATS:]
    if len(tail) == LOOP_REPEATS and len(set(tail)) == 1:
        unlooped = allowed.copy()
        unlooped[tail[0]] = False
        allowed = unlooped if unlooped.any() else allowed
    for token_id in matcher.single_tokens(STRING_ENDS if matcher.in_string else STRUCTURE_ENDS):
        if token_id < vocab and allowed[token_id]:
            only = np.zeros_like(allowed)
            only[token_id] = True
            return only
    fresh = allowed.copy()
    fresh[recent] = False
    return fresh if fresh.any() else allowed


def _grammar_takes_argmax(row: np.ndarray, request: Request, matcher: RequestMatcher) -> bool:
    """Whether a greedy row with nothing else to process needs no mask: its grammar allows
    the raw argmax, which is then the masked argmax too (checking one token costs a few
    µs, a mask tens)."""
    params = request.sampling_params
    if (
        params.temperature != 0.0
        or params.logit_bias
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or len(request.output_token_ids) < params.min_tokens
        or winding_up(request)
    ):
        return False
    return matcher.accepts(int(row.argmax()))


class LogitsProcessor:
    """Applies a step's processing in place; keeps each request's prompt-token mask for
    the repetition penalty (built once, dropped with `drop`)."""

    def __init__(self) -> None:
        self._prompt_masks: dict[str, torch.Tensor] = {}

    def drop(self, request_id: str) -> None:
        self._prompt_masks.pop(request_id, None)

    def apply(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        requests: Sequence[Request],
        matchers: Mapping[str, RequestMatcher],
        mask_words: int = 0,
    ) -> None:
        """logits: [N, V] fp32 on CPU; rows[i] is the row of requests[i]. A request in
        `matchers` whose matcher is active gets its grammar's mask."""
        vocab = logits.shape[1]
        values = logits.numpy()
        constrained = [
            (row, r, matchers[r.request_id])
            for row, r in zip(rows, requests, strict=True)
            if r.request_id in matchers
            and matchers[r.request_id].active
            and not _grammar_takes_argmax(values[row], r, matchers[r.request_id])
        ]
        allowed: dict[int, np.ndarray] = {}
        if constrained:
            bits = grammar_allowed([m for _, _, m in constrained], mask_words, vocab)
            allowed = {row: bits[j] for j, (row, _, _) in enumerate(constrained)}
            for row, request, matcher in constrained:
                if winding_up(request):
                    allowed[row] = _wind_up(allowed[row], matcher, request)

        penalised: list[tuple[int, Request]] = []
        for row, request in zip(rows, requests, strict=True):
            params = request.sampling_params
            if params.min_tokens and len(request.output_token_ids) < params.min_tokens:
                stops = list(params.stop_token_ids)
                if not params.ignore_eos:
                    stops.extend(request.eos_token_ids)
                stops = [t for t in stops if t < vocab]
                mask = allowed.get(row)
                if stops and (mask is None or int(mask.sum()) > int(mask[stops].sum())):
                    logits[row, stops] = NEG_INF
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
                bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
                logits[row].index_add_(0, ids, bias)
            if (
                params.repetition_penalty != 1.0
                or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0
            ):
                penalised.append((row, request))
        if penalised:
            self._penalise(logits, penalised)
        for row, mask in allowed.items():
            np.putmask(values[row], ~mask, NEG_INF)

    def _penalise(self, logits: torch.Tensor, penalised: list[tuple[int, Request]]) -> None:
        vocab = logits.shape[1]
        idx = torch.tensor([row for row, _ in penalised])
        sub = logits.index_select(0, idx)
        counts = torch.stack(
            [
                torch.bincount(
                    torch.tensor(output_token_ids(r), dtype=torch.int64), minlength=vocab
                )[:vocab]
                for _, r in penalised
            ]
        ).to(logits.dtype)
        seen = counts > 0
        params = [r.sampling_params for _, r in penalised]
        rep = [p.repetition_penalty for p in params]
        if any(x != 1.0 for x in rep):
            in_prompt = torch.stack([self._prompt_mask(r, vocab) for _, r in penalised])
            factor = torch.tensor(rep, dtype=logits.dtype)[:, None].expand_as(sub)
            factor = torch.where(in_prompt | seen, factor, 1.0)
            sub = torch.where(sub > 0, sub / factor, sub * factor)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)
        sub -= freq[:, None] * counts
        sub -= pres[:, None] * seen
        logits.index_copy_(0, idx, sub)

    def _prompt_mask(self, request: Request, vocab: int) -> torch.Tensor:
        mask = self._prompt_masks.get(request.request_id)
        if mask is None:
            resumed = request.num_resumed_tokens
            prompt = request.prompt_token_ids
            prompt = prompt[: len(prompt) - resumed]
            mask = torch.zeros(vocab, dtype=torch.bool)
            if prompt:
                ids = torch.tensor(prompt, dtype=torch.int64)
                mask[ids[ids < vocab]] = True
            self._prompt_masks[request.request_id] = mask
        return mask
