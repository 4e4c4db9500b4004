"""The sim engine's parts: a modelled GPU, served by `engine.backends.sim_backend`.

`presets` holds the latency model and the named setups it is calibrated to; `core` the
continuous-batching bookkeeping (token budget, KV blocks, preemption, prefix cache) that
decides what each modelled step holds. No torch, no weights: a model, not a measurement.
"""
