"""Tuning a real vLLM: its engine arguments as a config, their search space, a backend that restarts vLLM per
trial, a simulator in vLLM's scheduling mode calibrated from vLLM's own iteration log, and the screened search.

The vLLM side (its launcher, `VllmConfig`, the argument check, the OpenAI client) is `integrations.vllm`.

- `space` (+ `space.yml`): the search space in the same YAML form and parser as `tuner/space.yml`;
- `backend`: `VllmBackend`, one vLLM start per trial (through `integrations.vllm.VllmLauncher`);
- `calibrate`: the cost model fitted to the steps the collector stored from vLLM's iteration lines (read with
  `collector.queries.stored_steps`);
- `sim`: the kvpilot scheduler and KV cache manager in vLLM V1's mode, on that cost model;
- `fidelity`: every live replay re-run in the simulator and compared;
- `screen`: simulation-screened search, live confirmation, the held-out check;
- `proposal`: vLLM's `--config` file, the markdown report and the proposals row.
- `tune`: one screened tuning from the running config to a proposal (`kvpilot tune vllm`, `bench tune-vllm`).
"""
