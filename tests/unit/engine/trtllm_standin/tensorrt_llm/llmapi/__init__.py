"""Stand-in for `tensorrt_llm.llmapi`: the LLM API names the trtllm backend uses."""

from tensorrt_llm.llmapi.llm import LLM, CompletionOutput, IterationResult, RequestOutput
from tensorrt_llm.llmapi.llm_args import KvCacheConfig
from tensorrt_llm.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "IterationResult",
    "KvCacheConfig",
    "RequestOutput",
    "SamplingParams",
]
