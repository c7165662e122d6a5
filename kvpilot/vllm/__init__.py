"""`kvpilot vllm calibrate` and the local bench it and the vLLM benchmarks run on (`workbench`).

The vLLM integration itself (launcher, log parsing, config, client) is `integrations.vllm`.
"""
