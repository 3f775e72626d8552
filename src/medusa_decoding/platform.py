"""Facts of the machine: where the cache lives and what the CPU can do. Below every other module."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch


def cache_dir() -> Path:
    return Path(os.environ.get("MEDUSA_CACHE", Path.home() / ".cache" / "medusa-decoding"))


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")  # what changes the CPU kernels
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # bf16 dot products in hardware


def cpu_info() -> tuple[str, list[str]]:
    """-> (CPU model name, the ISA_FLAGS it has), from /proc/cpuinfo where there is one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    name, flags = platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == platform.machine():
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, [f for f in ISA_FLAGS if f in flags]


def processor_info(device: torch.device) -> tuple[str, list[str]]:
    """-> (the processor a model runs on, its ISA_FLAGS): the GPU's name (no flags) or cpu_info()."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device), []
    return cpu_info()


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot products in hardware (AVX-512 BF16 or AMX)."""
    return any(f in cpu_info()[1] for f in NATIVE_BF16)


def busy_cpu_s() -> float | None:
    """CPU seconds every process on the machine has run so far (Linux's /proc/stat: user, nice,
    system, irq, softirq and steal, the time a hypervisor gave to other guests), or None where it
    cannot be read."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks[i] for i in (0, 1, 2, 5, 6, 7) if i < len(ticks))
    return busy / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Other processes' CPU use while a block runs: the machine's busy CPU time less this process's
    own, over the block's wall time, in cores (`cores`; None where the machine's cannot be read).
    A timing taken while others ran is not this machine's cost: callers do not cache it."""

    cores: float | None = None

    def __enter__(self) -> OtherLoad:
        self._t0, self._own0, self._busy0 = time.perf_counter(), time.process_time(), busy_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall, own, busy = time.perf_counter() - self._t0, time.process_time() - self._own0, busy_cpu_s()
        if self._busy0 is not None and busy is not None and wall > 0:
            self.cores = max(busy - self._busy0 - own, 0.0) / wall

    def above(self, cores: float) -> bool:
        """Did other processes use more than `cores` (False where their load could not be read)?"""
        return self.cores is not None and self.cores > cores
