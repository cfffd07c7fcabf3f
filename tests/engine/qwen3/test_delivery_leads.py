from __future__ import annotations

import pytest

from engine.qwen3.delivery_leads import DeliveryLeads
from engine.qwen3.request import RequestStatus
from tests.engine.qwen3.utils import FakeClock, create_requests, create_scheduler, fake_output


def _run(dt: float, frames: int = 40):
    """One request through the scheduler with `dt` seconds per step; returns (scheduler, request)."""
    clock = FakeClock()
    sched = create_scheduler(clock=clock, safety_margin_s=0.1)
    (r,) = create_requests(1, prompt_len=3, max_frames=frames)
    sched.add_request(r)
    for _ in range(frames + 10):
        plan = sched.schedule()
        clock.t += dt
        sched.update(plan, fake_output(plan))
        if r.status == RequestStatus.FINISHED_STOPPED:
            break
    assert r.status == RequestStatus.FINISHED_STOPPED
    return sched, r


def test_an_engine_faster_than_real_time_hands_every_chunk_out_early():
    sched, r = _run(dt=0.02)
    figures = sched.leads.snapshot(sched.clock())
    assert r.min_lead_s > 0
    assert figures["lead_late_chunks_pct"] == 0
    assert figures["lead_chunk_p1_ms"] > 0
    assert figures["lead_stream_min_p10_ms"] == pytest.approx(1000 * r.min_lead_s)
    assert figures["lead_streams_late_behind_buffer_pct"] == 0


def test_an_engine_slower_than_real_time_falls_behind_the_playback_clock():
    # 100 ms per frame against 80 ms of audio: every later chunk comes later than the one before
    sched, r = _run(dt=0.1)
    figures = sched.leads.snapshot(sched.clock())
    assert r.min_lead_s < -0.15  # 40 frames: 2 s behind by the end
    assert figures["lead_late_chunks_pct"] > 50
    assert figures["lead_streams_late_behind_buffer_pct"] == 100


def test_figures_cover_only_the_window():
    leads = DeliveryLeads(window_s=10.0)
    leads.chunk(0.0, -1.0)
    leads.stream_done(0.0, -1.0)
    leads.chunk(15.0, 0.2)
    leads.stream_done(15.0, float("inf"))  # one chunk only: no lead, not counted
    figures = leads.snapshot(20.0)
    assert figures["lead_late_chunks_pct"] == 0 and figures["lead_chunk_p50_ms"] == pytest.approx(200)
    assert "lead_stream_min_p10_ms" not in figures
