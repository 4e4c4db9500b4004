"""Stand-in for NVIDIA's `tensorrt_llm`: the names the trtllm backend imports from the top.

Not the real package: a toy model behind the same signatures (engine/backends/trtllm_api.txt),
so the backend's tests run without a GPU.
"""

from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.sampling_params import SamplingParams

__version__ = "0.0.0+standin"

__all__ = ["LLM", "SamplingParams", "__version__"]
