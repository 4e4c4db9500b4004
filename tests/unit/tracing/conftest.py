from tests.unit.tracing.memory_spans import spans

__all__ = ["spans"]
