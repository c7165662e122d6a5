"""Device gauges: NVML (nvidia-ml-py) when a GPU is present, torch.cuda memory stats otherwise.

On CPU there is no device to ask, so the sampler is absent and telemetry reports the KV pool and
the busy fraction instead. NVML failures are logged once and the sampler falls back to torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("kvpilot.engine.device")


@dataclass(frozen=True, slots=True)
class DeviceSample:
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float | None
    source: str


class DeviceSampler:
    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # ImportError, NVMLError: both mean "use torch"
            log.info("NVML unavailable (%s); sampling torch.cuda memory stats", exc)

    @classmethod
    def for_device(cls, device: str) -> DeviceSampler | None:
        return cls() if device == "cuda" and torch.cuda.is_available() else None

    def sample(self) -> DeviceSample | None:
        if self._nvml is not None:
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                return DeviceSample(int(mem.used), int(mem.total), util.gpu / 100.0, "nvml")
            except Exception as exc:
                log.warning("NVML sample failed (%s); falling back to torch.cuda", exc)
                self._nvml = None
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(self.index)
        return DeviceSample(int(total - free), int(total), None, "torch.cuda")
