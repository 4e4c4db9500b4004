"""Perplexity of one fixed text for `sluice bench engine`: Sluice's engine (its prompt
logprobs) and llama.cpp (its logits, `logits_all`) on the same token ids of the same
file, so a quantized path's output quality is judged beside llama.cpp's on its own
weights."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sluice.engine.backends.base import EngineDelta
from sluice.engine.sampling import SamplingParams

# The opening of the US Declaration of Independence (public domain): fixed, ordinary
# English prose.
TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve "
    "the political bands which have connected them with another, and to assume among the "
    "powers of the earth, the separate and equal station to which the Laws of Nature and of "
    "Nature's God entitle them, a decent respect to the opinions of mankind requires that "
    "they should declare the causes which impel them to the separation. We hold these "
    "truths to be self-evident, that all men are created equal, that they are endowed by "
    "their Creator with certain unalienable Rights, that among these are Life, Liberty and "
    "the pursuit of Happiness. That to secure these rights, Governments are instituted "
    "among Men, deriving their just powers from the consent of the governed, That whenever "
    "any Form of Government becomes destructive of these ends, it is the Right of the "
    "People to alter or to abolish it, and to institute new Government, laying its "
    "foundation on such principles and organizing its powers in such form, as to them "
    "shall seem most likely to effect their Safety and Happiness. Prudence, indeed, will "
    "dictate that Governments long established should not be changed for light and "
    "transient causes; and accordingly all experience hath shewn, that mankind are more "
    "disposed to suffer, while evils are sufferable, than to right themselves by "
    "abolishing the forms to which they are accustomed."
)


def sluice_perplexity(run: object, ids: list[int]) -> float:
    """exp of the mean negative logprob of ids[1:] given the ids before each, from the
    prompt logprobs of one request on `run` (a `benchmarks.engine.SluiceRun`)."""
    logprobs: list[float] = []

    def collect(delta: EngineDelta) -> None:
        for p in delta.prompt_logprobs or []:
            if p is not None:
                logprobs.append(p.logprob)

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    run.run([ids], [1], "ppl", params=[params], on_delta=collect)  # type: ignore[attr-defined]
    if len(logprobs) != len(ids) - 1:
        raise RuntimeError(f"{len(logprobs)} prompt logprobs for {len(ids)} tokens")
    return math.exp(-sum(logprobs) / len(logprobs))


def llama_cpp_perplexity(gguf: Path, ids: list[int]) -> float:
    """The same from llama.cpp's logits of every position (2 threads, as every system)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf), n_ctx=2048, n_threads=2, n_batch=512, logits_all=True,
        verbose=False,
    )  # fmt: skip
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    picked = logits[np.arange(len(ids) - 1), ids[1:]]
    return math.exp(float(np.mean(logz - picked)))
