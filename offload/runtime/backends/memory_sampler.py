"""Device memory as the device sees it: a daemon thread samples the free and total bytes the driver reports
(cudaMemGetInfo: the CUDA context, library modules, the allocator's cache and other processes all count) and
keeps the peak in use. It knows no device: the CUDA backend hands it torch's mem_get_info, a test a fake."""

from __future__ import annotations

import threading
from collections.abc import Callable

SAMPLE_INTERVAL_S = 0.05  # a sample is one driver query (microseconds); a step of a 70B model takes longer


class DeviceMemorySampler:
    """Samples mem_get_info() -> (free, total) every interval_s between start() and stop(); peak_used_bytes is the
    most in use at any sample."""

    def __init__(self, mem_get_info: Callable[[], tuple[int, int]], interval_s: float = SAMPLE_INTERVAL_S):
        self._mem_get_info, self.interval_s = mem_get_info, interval_s
        self.peak_used_bytes = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        """Bytes in use on the device now (the peak kept)."""
        free, total = self._mem_get_info()
        with self._lock:
            self.peak_used_bytes = max(self.peak_used_bytes, total - free)
        return total - free

    def reset(self) -> None:
        """Start the peak afresh from what is in use now."""
        with self._lock:
            self.peak_used_bytes = 0
        self.sample()

    def start(self) -> None:
        if self._thread is not None:
            return
        self.sample()
        self._done.clear()
        self._thread = threading.Thread(target=self._run, name="offload-device-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._done.set()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                self.sample()
            except RuntimeError:  # the CUDA runtime is shutting down (interpreter exit)
                return


def device_peak_bytes(sampled_peak: int, reserved_peak: int, outside_allocator_bytes: int) -> int:
    """The device's peak in use: the sampled peak, or the allocator's reserved peak plus what the process held
    outside the allocator (context, modules; measured when the backend started), whichever is higher: a spike
    shorter than a sampling interval still shows in the second."""
    return max(sampled_peak, reserved_peak + outside_allocator_bytes)
