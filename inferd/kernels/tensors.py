"""Host data onto the device without a host sync."""

from __future__ import annotations

import torch


def device_tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`. To a GPU through pinned memory and a non-blocking
    copy: torch waits for a blocking copy to finish, a host sync on every step."""
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, likewise without a host sync."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
