"""The device calls remat makes outside its transports, through `torch.accelerator` (CUDA, XPU, MPS, any
accelerator torch knows): synchronizing, the allocator's counts, timing events, the device's name. In one
place, so that no `torch.cuda` call is left elsewhere (tests/test_architecture.py checks); on a CPU every
call is a no-op or None."""

from __future__ import annotations

import platform
from typing import Any

import torch

OUT_OF_MEMORY = torch.OutOfMemoryError  # any accelerator's (torch >= 2.5)


def is_accelerator(device: torch.device) -> bool:
    """Whether `device` is the machine's accelerator (its allocator and streams are `torch.accelerator`'s)."""
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return current is not None and device.type == current.type


def synchronize(device: torch.device) -> None:
    if is_accelerator(device):
        torch.accelerator.synchronize(device)


def memory_allocated(device: torch.device) -> int | None:
    """The allocator's live bytes on `device` (None on a CPU, which has no such count)."""
    return torch.accelerator.memory_allocated(device) if is_accelerator(device) else None


def _in_use() -> bool:
    """An accelerator this process already uses (reading an unused one would start it)."""
    if not torch.accelerator.is_available():
        return False
    if torch.accelerator.current_accelerator().type == "cuda":
        return torch.cuda.is_initialized()
    return True


def peak_allocated() -> int | None:
    """The current accelerator's peak since `reset_peak()` (None without one in use)."""
    return torch.accelerator.max_memory_allocated() if _in_use() else None


def reset_peak() -> None:
    if _in_use():
        torch.accelerator.reset_peak_memory_stats()


def empty_cache() -> None:
    if _in_use():
        torch.accelerator.empty_cache()


def timing_event() -> Any:
    """A recorded event on the current stream, whose `elapsed_time` to a later one is in milliseconds."""
    event = torch.Event(enable_timing=True)
    event.record()
    return event


def device_name() -> str:
    """The accelerator's name (CUDA's product name), else the CPU's model."""
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        return torch.cuda.get_device_name() if kind == "cuda" else kind
    return f"cpu {platform.machine()} {_cpu_name()}".strip()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
