"""kvpilot's inference engine: paged hot/cold KV cache, continuous batching, telemetry."""
