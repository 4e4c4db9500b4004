"""Batched token sampling from logits: greedy, temperature, top-k, top-p, seeds, logprobs.

Called by `engine.runner.model_runner` after the model step, one row per request that
samples. Order of operations (as vLLM and TensorRT-LLM apply them): temperature, then top-k,
then top-p, then draw. Temperature 0 is greedy (argmax). A request with a seed draws from its own
`torch.Generator`, so its tokens do not depend on its batch neighbours; others share the
sampler's generator. Logprobs are the raw log-softmax of the unprocessed logits (before
penalties, bias and grammar, as vLLM returns them by default).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from sluice.engine.sampling import SamplingParams


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # seed=None: one draw of OS entropy here, none per step, so requests without a
        # seed sample differently in every engine and after every restart
        self.generator = torch.Generator()
        self.generator.manual_seed(secrets.randbits(64) if seed is None else seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        raw: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits [N, V] float32 -> one token per row (+ logprobs where asked). raw: the
        logits before `engine.logits` processed them (the logprobs' source; default
        `logits`)."""
        n = logits.shape[0]
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            tokens = greedy_tokens(logits)
        else:
            tokens = torch.empty(n, dtype=torch.int64)
            g_rows = [i for i in range(n) if greedy[i]]
            if g_rows:
                idx = torch.tensor(g_rows)
                tokens[idx] = greedy_tokens(logits[idx])
            s_rows = [i for i in range(n) if not greedy[i]]
            idx = torch.tensor(s_rows)
            probs = _processed_probs(logits[idx], [params[i] for i in s_rows])
            tokens[idx] = _draw(probs, [generators[i] for i in s_rows], self.generator)
        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * n
        tops: list[list[tuple[int, float]] | None] = [None] * n
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            idx = torch.tensor(want)
            lp = torch.log_softmax((logits if raw is None else raw)[idx].float(), dim=-1)
            chosen = lp.gather(1, tokens[idx][:, None]).squeeze(1).tolist()
            k_max = max(params[i].logprobs or 0 for i in want)
            top_v, top_i = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
            top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(want):
                k = params[i].logprobs or 0
                logprobs[i] = chosen[j]
                tops[i] = list(zip(top_i_l[j][:k], top_v_l[j][:k], strict=True))
        return SamplerOutput(token_list, logprobs, tops)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax (first maximum, like torch). On CPU through numpy: torch's CPU argmax is
    scalar code, ~28 µs for one 32000-wide row vs ~3 µs."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k and top-p row by row (vectorised); return probabilities."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    logits = logits / temps[:, None]
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
        ranks = torch.arange(vocab)[None, :]
        remove = ranks >= ks[:, None]
        if any(p < 1.0 for p in top_ps):
            sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            cum = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass before each token
            ps = torch.tensor(top_ps, dtype=logits.dtype)
            remove |= cum >= ps[:, None]
            remove[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    return torch.softmax(logits, dim=-1)


def _draw(
    probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator
) -> torch.Tensor:
    """Exponential-race draw (argmax p/q, q ~ Exp(1)): seeded rows use their own generator."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return (probs / q).argmax(dim=-1)
