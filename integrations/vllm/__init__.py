"""vLLM as a kvpilot source and tuning target: everything that knows vLLM's processes, logs, spans and API.

- `wiring`: vLLM's command line and environment, its scrape target, where its interpreter is;
- `launcher`: `VllmLauncher(LaunchOptions(...)).start()` runs vLLM and ships its iteration lines;
- `iteration_log`: vLLM's iteration log lines as steps, placed at the times they ran;
- `tail`: ships a vLLM log file, remembering how far it got;
- `asgi/`: the arrival-stamp middleware vLLM loads from its own interpreter (a directory, not a package);
- `config`: `VllmConfig`, the tunable engine arguments and the fixed serve arguments; CLI args and `--config` YAML;
- `argcheck`: a search space checked against the installed vLLM's own argument parser and config validation;
- `client`: replays a workload through vLLM's OpenAI API at the recorded arrival times.
"""

from integrations.vllm.launcher import LaunchOptions, VllmExitedError, VllmLauncher
from integrations.vllm.wiring import VllmSetupError, find_vllm_python

__all__ = ["LaunchOptions", "VllmExitedError", "VllmLauncher", "VllmSetupError", "find_vllm_python"]
