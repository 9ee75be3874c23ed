"""The SM clock, power and clock-limit reasons of a GPU while a timed loop runs (NVML, read only).

A tensor-core-bound loop of hundreds of milliseconds (prefill at 16k) can draw the GPU to its power
limit, which lowers the SM clock: its TFLOP/s then depend on how long and after what it ran. The
benchmarks record the clock beside each time so that two runs can be compared. NVML comes with the
driver (``libnvidia-ml.so.1``); without it :class:`ClockSampler` records nothing and says so.
"""

from __future__ import annotations

import ctypes
import threading
import time

#: bits of nvmlDeviceGetCurrentClocksEventReasons (nvml.h), the ones that lower the clock under load
LIMIT_REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                 0x80: "hw_power_brake"}
_NVML_CLOCK_SM = 1
_nvml = None


def _library():
    """NVML, initialized once; None where the driver's library is missing or fails to initialize."""
    global _nvml
    if _nvml is None:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            _nvml = lib if lib.nvmlInit_v2() == 0 else False
        except OSError:
            _nvml = False
    return _nvml or None


class ClockSampler:
    """Samples device ``index`` every ``period_s`` in a thread between ``__enter__`` and ``__exit__``.

    ``summary()`` gives the mean and lowest SM clock (MHz), the mean power (W) and the clock-limit
    reasons seen in any sample; ``{}`` where NVML is not available.
    """

    def __init__(self, index: int = 0, period_s: float = 0.002):
        self.period_s = period_s
        self.samples: list[tuple[int, float, int]] = []
        self._lib = _library()
        self._handle = ctypes.c_void_p()
        if self._lib is not None and self._lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)):
            self._lib = None
        self._reasons_fn = None if self._lib is None else (
            getattr(self._lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or getattr(self._lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None))  # older drivers
        self._stop = threading.Event()
        self._thread = None

    def _sample(self):
        clock, power, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        if self._lib.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(clock)):
            return
        self._lib.nvmlDeviceGetPowerUsage(self._handle, ctypes.byref(power))
        if self._reasons_fn is not None:
            self._reasons_fn(self._handle, ctypes.byref(reasons))
        self.samples.append((clock.value, power.value / 1000.0, reasons.value))

    def _loop(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period_s)

    def __enter__(self):
        if self._lib is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return False

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks = [c for c, _, _ in self.samples]
        seen = 0
        for _, _, r in self.samples:
            seen |= r
        return {"sm_clock_mhz": round(sum(clocks) / len(clocks)), "sm_clock_min_mhz": min(clocks),
                "power_w": round(sum(p for _, p, _ in self.samples) / len(self.samples), 1),
                "clock_limits": [name for bit, name in LIMIT_REASONS.items() if seen & bit],
                "clock_samples": len(clocks)}
