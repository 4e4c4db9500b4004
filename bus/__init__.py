"""The event bus: wire contracts (topics, messages) and transports (Kafka, in-memory).

The only package that imports kafka. Everything else sees `EventBus` and the pydantic
messages in `bus.messages`.
"""
