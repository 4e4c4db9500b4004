"""The kernels' process options: one library per process, so one set of options for it."""

from __future__ import annotations

from sluice.engine.options import EngineOptions

# The composition root sets them with `configure` (through
# `engine.options.apply_process_options`) before the model loads.
_options = EngineOptions()


def options() -> EngineOptions:
    """The options in force (kernels on or off, cache dir, parallel threshold)."""
    return _options


def set_options(options: EngineOptions) -> None:
    global _options
    _options = options
