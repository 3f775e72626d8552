"""Facts of the machine: where the cache lives and what the CPU can do. Below every other module."""

from __future__ import annotations

import os
import platform
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
