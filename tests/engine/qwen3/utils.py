"""Builders for scheduler tests (after vLLM's tests/v1/core/utils.py) and engine configs."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from engine.api import ChunkSchedule, Priority, TextSegment
from engine.qwen3.kv_cache import KVCacheLayout, KVCacheManager
from engine.qwen3.plan import StepOutput, StepPlan
from engine.qwen3.request import SAMPLES_PER_FRAME, Request, Segment
from engine.qwen3.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from engine.qwen3.engine import Qwen3Engine, Qwen3EngineConfig

EOS = 2150


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def create_scheduler(
    num_kv_slots: int = 8,
    max_len: int = 256,
    clock: FakeClock | None = None,
    codec_delivery_steps: int = 0,
    **config: object,
) -> Scheduler:
    layout = KVCacheLayout(num_slots=num_kv_slots, max_len=max_len, bytes_per_token=1024)
    cfg = SchedulerConfig(**config)  # type: ignore[arg-type]
    return Scheduler(
        cfg,
        KVCacheManager(layout),
        clock=clock or FakeClock(),
        eos_code=EOS,
        codec_delivery_steps=codec_delivery_steps,
    )


def engine_config(**settings: object) -> Qwen3EngineConfig:
    """A Qwen3EngineConfig from flat settings, each given to the config that owns it (`max_streams`
    is the scheduler's `codec_slots`); an unknown name raises TypeError."""
    from engine.qwen3.engine import Qwen3EngineConfig
    from engine.qwen3.runner import RunnerConfig

    owned: dict[str, dict[str, object]] = {"scheduler": {}, "runner": {}, "engine": {}}
    names = {
        "scheduler": {f.name for f in fields(SchedulerConfig)},
        "runner": {f.name for f in fields(RunnerConfig)},
        "engine": {f.name for f in fields(Qwen3EngineConfig)} - {"scheduler", "runner"},
    }
    for name, value in settings.items():
        name = "codec_slots" if name == "max_streams" else name
        owner = next((o for o, known in names.items() if name in known), None)
        if owner is None:
            raise TypeError(f"no engine setting {name!r}")
        owned[owner][name] = value
    return Qwen3EngineConfig(
        scheduler=SchedulerConfig(**owned["scheduler"]),  # type: ignore[arg-type]
        runner=RunnerConfig(**owned["runner"]),  # type: ignore[arg-type]
        **owned["engine"],  # type: ignore[arg-type]
    )


def make_segment(prompt_len: int = 10, max_frames: int = 100, text: str = "hello world") -> Segment:
    return Segment(text=TextSegment(text, char_start=0), prompt_len=prompt_len, max_frames=max_frames)


def create_requests(
    n: int,
    prompt_len: int = 10,
    max_frames: int = 100,
    segments: int = 1,
    priority: Priority = Priority.INTERACTIVE,
    schedule: ChunkSchedule | None = None,
    prefix: str = "r",
    arrival_time: float = 0.0,
    closed: bool = True,
) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(
            request_id=f"{prefix}{i}",
            priority=priority,
            schedule=schedule or ChunkSchedule(),
            arrival_time=arrival_time,
        )
        for _ in range(segments):
            r.segments.append(make_segment(prompt_len, max_frames))
        r.text_closed = closed
        reqs.append(r)
    return reqs


def fake_output(plan: StepPlan, eos_for: set[str] | None = None) -> StepOutput:
    """A runner stand-in: frame codes are (row index + 1) repeated, EOS for the ids in eos_for;
    audio is ones of the right length (first frames decoded in the step that samples them)."""
    import numpy as np

    eos_for = eos_for or set()
    codes = [[EOS if rid in eos_for else i + 1] * 16 for i, rid in enumerate(plan.sampling_rows)]
    audio = {c.request_id: np.ones(c.num_frames * SAMPLES_PER_FRAME, np.float32) for c in plan.codec}
    # like the runner: a first frame sampled this step is decoded in this step, unless it was EOS
    audio |= {
        f.request_id: np.ones(SAMPLES_PER_FRAME, np.float32)
        for f in plan.first_audio_now
        if f.request_id not in eos_for
    }
    return StepOutput(codes=codes, audio=audio)


def run_steps(sched: Scheduler, steps: int, clock: FakeClock | None = None, dt: float = 0.01):
    """Schedule/update `steps` times; returns the plans and outputs."""
    plans, outs = [], []
    for _ in range(steps):
        plan = sched.schedule()
        if clock is not None:
            clock.t += dt
        outs.extend(sched.update(plan, fake_output(plan)))
        plans.append(plan)
    return plans, outs


def tiny_base_engine(directory: Path) -> Qwen3Engine:
    """A tiny random Base (voice clone) checkpoint written into `directory`, served on the CPU
    eagerly with two streams; its steps are driven by hand (`_ready` set, no step thread)."""
    import torch

    from engine.qwen3.engine import Qwen3Engine
    from tests.reference_builders import build_reference_tts

    path = build_reference_tts("base", directory)
    torch.manual_seed(0)
    config = engine_config(
        max_streams=2, kv_slots=2, max_len=160, max_batch=2, enforce_eager=True, progress_bar=False
    )
    eng = Qwen3Engine.from_pretrained(path, "cpu", torch.float32, config)
    eng._ready = True
    return eng
