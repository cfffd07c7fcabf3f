"""A kernel's switch: checked once per device, off (eager ops serve) when its comparison fails."""

from __future__ import annotations

import torch

from engine.qwen3.models.kernel_guard import KernelGuard


def test_a_failed_comparison_turns_the_kernel_off_and_it_is_asked_once_per_device(monkeypatch):
    calls: list[torch.device] = []

    def compare(device: torch.device) -> None:
        calls.append(device)
        raise ValueError("differs")

    guard = KernelGuard("test kernel", compare, built=True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert guard.ready(torch.device("cuda", 0)) is False and not guard.enabled
    assert guard.ready(torch.device("cuda", 0)) is False
    assert calls == [torch.device("cuda", 0)]
    guard.check(torch.device("cuda"))  # an index-less device counts as the current one
    assert calls == [torch.device("cuda", 0)]  # off already: no second comparison


def test_a_passing_comparison_keeps_it_on_and_cpu_or_unbuilt_never_uses_it():
    guard = KernelGuard("test kernel", lambda device: None, built=True)
    assert guard.ready(torch.device("cuda", 0)) and guard.enabled
    assert guard.check(torch.device("cpu")) is False and guard.enabled  # CPU: not for this kernel
    unbuilt = KernelGuard("test kernel", lambda device: None, built=False)
    assert unbuilt.ready(torch.device("cuda", 0)) is False
