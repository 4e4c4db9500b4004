"""Sluice's inference engine: bookkeeping in `engine.core`, torch in `engine.runner` and
`engine.models`, backends (torch, trtllm, sim) in `engine.backends`.

Imports nothing else of Sluice's (docs/architecture.md §3); talks to the pipeline only through the
`EngineBackend` protocol.
"""
