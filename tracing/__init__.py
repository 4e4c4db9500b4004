"""OpenTelemetry setup, Kafka header propagation, metric and span names."""
