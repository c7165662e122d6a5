"""vLLM as a kvpilot source: `kvpilot vllm serve` (launcher), `kvpilot collector tail` (log files).

- `wiring`: vLLM's command line and environment, its scrape target, where its interpreter is;
- `launcher`: `VllmLauncher(LaunchOptions(...)).start()` runs vLLM and ships its iteration lines;
- `tail`: ships a vLLM log file, remembering how far it got.
"""

from kvpilot.vllm.launcher import LaunchOptions, VllmExitedError, VllmLauncher
from kvpilot.vllm.wiring import VllmSetupError, find_vllm_python

__all__ = ["LaunchOptions", "VllmExitedError", "VllmLauncher", "VllmSetupError", "find_vllm_python"]
