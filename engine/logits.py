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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from engine.core.request import Request
from engine.structured import RequestMatcher

NEG_INF = float("-inf")


def output_token_ids(request: Request) -> list[int]:
    """The tokens penalties and grammars count as output: an earlier attempt's (resumed,
    the prompt's tail) and this attempt's."""
    resumed = request.num_resumed_tokens
    if not resumed:
        return request.output_token_ids
    return request.prompt_token_ids[-resumed:] + request.output_token_ids


def grammar_allowed(
    matchers: Sequence[RequestMatcher], mask_words: int, vocab: int
) -> torch.Tensor:
    """[len(matchers), vocab] bool: the tokens each grammar allows next."""
    words = np.zeros((len(matchers), mask_words), dtype=np.int32)
    for row, matcher in zip(words, matchers, strict=True):
        matcher.fill_mask(row)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.view(np.bool_))


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
        constrained = [
            (row, matchers[r.request_id])
            for row, r in zip(rows, requests, strict=True)
            if r.request_id in matchers and matchers[r.request_id].active
        ]
        allowed: dict[int, torch.Tensor] = {}
        if constrained:
            bits = grammar_allowed([m for _, m in constrained], mask_words, vocab)
            allowed = {row: bits[j] for j, (row, _) in enumerate(constrained)}

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
            logits[row].masked_fill_(~mask, NEG_INF)

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
