"""A CPU platform for verl, so its FSDP engine runs (on gloo) where no accelerator is.

verl >= 0.9 asks a platform singleton (``verl.plugin.platform``) for the device name, device
module and collective backend, and ships platforms only for accelerators (nvidia, huawei,
amd): with none present it falls back to 'nvidia' and its engine calls into CUDA. Its plugin
API is the documented way to add a device; this is that, for the CPU. It must be installed
before verl's FSDP engine module is imported: that module reads the device name once, at
import. Import this module only where verl is installed.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, platform_manager


@PlatformRegistry.register(platform="squall-cpu")
class PlatformCPU(PlatformBase):
    """The CPU as verl sees a device: torch.cpu, gloo, one 'device', nothing to profile."""

    device_name = "cpu"  # type: ignore[assignment]
    vendor_name = "cpu"  # type: ignore[assignment]

    @property
    def device_module(self) -> ModuleType:
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        # verl passes this to .to(), to_empty() and torch.device(): an index would mean cuda:N
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Any:
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def install_cpu_platform() -> None:
    """Make the CPU verl's platform (idempotent)."""
    current = platform_manager._current_platform
    if current is None or current.device_name != "cpu":
        platform_manager.set_platform(PlatformCPU())
