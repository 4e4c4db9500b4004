"""The tracing consumer: telemetry records → the engine-side spans of each request's trace."""
