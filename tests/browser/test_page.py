"""The browser page in real Chromium: it loads, speaks a sentence from eSpeak, highlights the words
in order on the playback clock, reports playback every 100 ms, and a barge-in at a known moment
reports the word that was playing."""

from __future__ import annotations

from typing import Any

from tests.browser.conftest import screenshot
from tests.integration.conftest import RunningGateway

SENTENCE = "The quick brown fox jumps over the lazy dog."
LONG = (
    "Cadence speaks while the words arrive, and it keeps talking for a good while, so that there is "
    "plenty of time to interrupt it somewhere in the middle of this rather long sentence."
)


def _open(page: Any, gateway: RunningGateway, text: str) -> None:
    page.goto(f"{gateway.http}/")
    page.wait_for_function("window.cadence !== undefined")
    page.select_option("#language", "English")
    page.fill("#text", text)
    page.click("#speak")


def test_page_speaks_and_highlights_words_in_order(page: Any, espeak_gateway: RunningGateway) -> None:
    _open(page, espeak_gateway, SENTENCE)
    page.wait_for_function("cadence.state.current && cadence.state.current.finished", timeout=20_000)
    cur = page.evaluate("""() => { const c = cadence.state.current;
        return {words: c.words, log: c.highlightLog, ttfa: c.ttfaMs, done: c.done, received: c.received}; }""")
    words, log = cur["words"], cur["log"]
    assert [w["text"] for w in words] == [w.strip(".") for w in SENTENCE.split()]
    indices = [entry["index"] for entry in log]
    assert indices == list(range(len(words)))  # every word, once, in order
    for entry in log:  # each on the playback clock: highlighted once its start has been played
        word = words[entry["index"]]
        assert word["start_ms"] <= entry["ms"] < word["start_ms"] + 120
    assert cur["done"] and abs(cur["done"]["duration_ms"] - cur["received"] * 1000 / 24000) <= 1
    assert 0 < cur["ttfa"] < 5000 and page.inner_text("#ttfa").endswith(" ms")
    assert page.inner_text("#underruns") == "0"
    reports = page.evaluate("window.sent.filter(s => s.msg.type === 'playback.report')")
    assert len(reports) >= 5
    played = [r["msg"]["played_ms"] for r in reports]
    assert played == sorted(played)
    gaps = [b["t"] - a["t"] for a, b in zip(reports, reports[1:], strict=False)]
    assert 60 < sorted(gaps)[len(gaps) // 2] < 160  # every 100 ms
    assert page.locator("#words .word").count() == len(words)


def test_barge_in_reports_the_word_that_was_playing(page: Any, espeak_gateway: RunningGateway) -> None:
    _open(page, espeak_gateway, LONG)
    page.wait_for_function("cadence.heardMs() >= 1500", timeout=20_000)
    page.click("#barge")
    page.wait_for_function("cadence.state.current.interruptReport !== null", timeout=10_000)
    cur = page.evaluate("""() => { const c = cadence.state.current;
        return {words: c.words, cut: c.interrupted, report: c.interruptReport}; }""")
    cut, report = cur["cut"], cur["report"]
    assert 1500 <= cut["playedMs"] < 2100  # the moment of the click, on the playback clock
    assert report["position_source"] == "client" and report["played_ms"] == cut["playedMs"]
    heard = report["partial_word"] or report["last_word"]
    assert heard["index"] == cut["highlighted"]  # the word on screen is the word the server names
    assert cur["words"][cut["highlighted"]]["start_ms"] <= cut["playedMs"]
    assert report["spoken_text"] == LONG[: report["last_word"]["char_end"]]
    cancel = page.evaluate("window.sent.filter(s => s.msg.type === 'speak.cancel')")
    assert [c["msg"]["played_ms"] for c in cancel] == [cut["playedMs"]]
    assert page.is_visible("#interrupt")
    assert page.inner_text("#last-word") == report["last_word"]["text"]
    assert page.inner_text("#spoken-text") == report["spoken_text"]
    page.wait_for_timeout(300)
    after = page.evaluate("cadence.state.position")
    assert after["uid"] is None  # the worklet stopped playing at the barge-in
    screenshot(page, "browser_page.png")


def test_stream_like_an_llm_sends_tokens_and_plays(page: Any, espeak_gateway: RunningGateway) -> None:
    page.goto(f"{espeak_gateway.http}/")
    page.wait_for_function("window.cadence !== undefined")
    page.select_option("#language", "English")
    page.check("#stream-llm")
    page.fill("#text", SENTENCE)
    page.click("#speak")
    page.wait_for_function("cadence.state.current && cadence.state.current.finished", timeout=20_000)
    appends = page.evaluate("window.sent.filter(s => s.msg.type === 'speak.append').map(s => s.msg.text)")
    assert len(appends) > len(SENTENCE.split()) and "".join(appends) == SENTENCE
    assert all(len(piece) <= 4 for piece in appends)
    log = page.evaluate("cadence.state.current.highlightLog.map(e => e.index)")
    assert log == list(range(len(SENTENCE.split())))


def test_microphone_energy_barges_in(page: Any, espeak_gateway: RunningGateway) -> None:
    # Chromium's fake capture device beeps: loud enough to count as the listener speaking
    page.goto(f"{espeak_gateway.http}/")
    page.wait_for_function("window.cadence !== undefined")
    page.select_option("#language", "English")
    page.fill("#text", LONG)
    page.evaluate("cadence.state.mic.attackMs = 60")  # the beeps are short
    page.check("#mic-barge")
    page.click("#speak")
    page.wait_for_function(
        "cadence.state.current && cadence.state.current.interruptReport !== null", timeout=20_000
    )
    cut = page.evaluate("cadence.state.current.interrupted")
    report = page.evaluate("cadence.state.current.interruptReport")
    assert cut["reason"] == "microphone"
    assert report["played_ms"] == cut["playedMs"] and report["position_source"] == "client"


def _open_pausing(page: Any, gateway: RunningGateway, text: str, resume_ms: int) -> None:
    page.goto(f"{gateway.http}/")
    page.wait_for_function("window.cadence !== undefined")
    page.select_option("#language", "English")
    page.check("#pause-barge")
    page.evaluate(f"cadence.state.falseInterruption.resumeMs = {resume_ms}")
    page.fill("#text", text)
    page.click("#speak")


def test_a_false_interruption_pauses_and_resumes_by_itself(page: Any, espeak_gateway: RunningGateway) -> None:
    _open_pausing(page, espeak_gateway, LONG, resume_ms=700)
    page.wait_for_function("cadence.heardMs() >= 1500", timeout=20_000)
    page.click("#barge")
    page.wait_for_function("cadence.state.current.pauseReport !== null", timeout=10_000)
    assert page.inner_text("#interrupt-title").startswith("Paused")
    held = page.evaluate("cadence.heardMs()")
    page.wait_for_timeout(300)
    assert page.evaluate("cadence.heardMs()") == held  # the listener hears nothing while paused
    page.wait_for_function("window.sent.some(s => s.msg.type === 'speak.unpause')", timeout=5_000)
    page.wait_for_function("cadence.state.current.finished", timeout=30_000)
    sent = page.evaluate("window.sent")
    kinds = [s["msg"]["type"] for s in sent]
    assert "speak.cancel" not in kinds
    [pause] = [s for s in sent if s["msg"]["type"] == "speak.pause"]
    [unpause] = [s for s in sent if s["msg"]["type"] == "speak.unpause"]
    assert 650 <= unpause["t"] - pause["t"] < 1500  # the false-interruption timer
    cur = page.evaluate("""() => { const c = cadence.state.current;
        return {words: c.words, log: c.highlightLog, report: c.pauseReport, done: c.done, received: c.received,
                played: cadence.state.position.played, interrupt: c.interruptReport}; }""")
    report = cur["report"]
    assert report["played_ms"] == pause["msg"]["played_ms"] >= 1400 and report["position_source"] == "client"
    assert report["spoken_text"] + report["unspoken_text"] == LONG
    assert cur["interrupt"] is None
    assert [e["index"] for e in cur["log"]] == list(range(len(cur["words"])))  # every word, once, in order
    assert cur["played"] == cur["received"]  # the player played every sample once: no gap, no repeat
    assert abs(cur["done"]["duration_ms"] - cur["received"] * 1000 / 24000) <= 1


def test_a_second_barge_in_while_paused_interrupts(page: Any, espeak_gateway: RunningGateway) -> None:
    _open_pausing(page, espeak_gateway, LONG, resume_ms=3000)
    page.wait_for_function("cadence.heardMs() >= 1200", timeout=20_000)
    page.click("#barge")
    page.wait_for_function("cadence.state.current.pauseReport !== null", timeout=10_000)
    assert page.inner_text("#barge") == "Interrupt"
    page.click("#barge")
    page.wait_for_function("cadence.state.current.interruptReport !== null", timeout=10_000)
    cur = page.evaluate("""() => { const c = cadence.state.current;
        return {paused: c.pauseReport, report: c.interruptReport, cut: c.interrupted}; }""")
    cancel = page.evaluate("window.sent.filter(s => s.msg.type === 'speak.cancel').map(s => s.msg)")
    assert [c["played_ms"] for c in cancel] == [cur["paused"]["played_ms"]]
    assert cur["report"]["played_ms"] == cur["paused"]["played_ms"]
    assert cur["report"]["last_word"] == cur["paused"]["last_word"]
    assert page.inner_text("#interrupt-title") == "Interrupted"
    page.wait_for_timeout(300)
    assert not page.evaluate("window.sent.some(s => s.msg.type === 'speak.unpause')")
    assert page.evaluate("cadence.state.position.uid") is None  # the worklet stopped
