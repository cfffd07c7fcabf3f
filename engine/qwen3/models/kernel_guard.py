"""The on/off switch of a Triton kernel that stands in for eager torch ops: on until its comparison
with those ops fails on a device (then off, with a warning, and the eager ops serve). Checked once
per device, before graphs are captured (the engine calls check() at start-up)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class KernelGuard:
    def __init__(self, name: str, compare: Callable[[torch.device], None], built: bool) -> None:
        """compare(device) raises when the kernel's result differs from the eager ops'; built: the
        kernel exists here (Triton imported)."""
        self.name = name
        self.compare = compare
        self.enabled = built
        self._checked: set[torch.device] = set()

    def ready(self, device: torch.device) -> bool:
        if device not in self._checked:
            self.check(device)
        return self.enabled

    def check(self, device: torch.device) -> bool:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._checked.add(device)
        if not (self.enabled and device.type == "cuda"):
            return False
        try:
            self.compare(device)
        except Exception as exc:  # a Triton build problem must not stop the engine: the eager ops work
            self.enabled = False
            log.warning("%s disabled: %s", self.name, exc)
            return False
        return True
