// The Cadence browser page: WS /v1/stream, playback through an AudioWorklet ring buffer, word
// highlighting on the playback clock, barge-in with the exact played position. With "pause first",
// a barge-in pauses (speak.pause) and resumes by itself (speak.unpause) unless the listener goes
// on speaking: a false-interruption timer, as voice agents have.
const RATE = 24000;
const PREBUFFER_MS = 60; // gathered before playback starts: a jitter margin for the first packets
const LANGUAGES = ["Auto", "English", "Chinese", "Japanese", "Korean", "German", "French", "Russian",
  "Portuguese", "Spanish", "Italian"];
const $ = (id) => document.getElementById(id);

const state = {
  ws: null, ctx: null, node: null, session: null, nextId: 1,
  streams: new Map(), // stream handle -> utterance id
  current: null, // the utterance on screen
  position: { uid: null, played: 0, at: 0 }, // the worklet's last report
  underruns: 0, buffered: 0, packets: 0,
  stopWaiters: new Map(), nextStop: 1,
  log: [], // events for tests: {t, kind, ...}
  mic: { thresholdDbfs: -35, attackMs: 100 }, // microphone barge-in: this loud for this long
  // pause first: resume after `resumeMs` without speech; `confirmMs` of speech meanwhile makes it
  // a real interruption (speak.cancel), and so does a second click on "Barge in"
  falseInterruption: { resumeMs: 2000, confirmMs: 600 },
};

function note(kind, fields = {}) { state.log.push({ t: performance.now(), kind, ...fields }); }
function latencyS() { return state.ctx ? (state.ctx.outputLatency || 0) + (state.ctx.baseLatency || 0) : 0; }

// -- audio ---------------------------------------------------------------------------------------
async function ensureAudio() {
  if (state.ctx) { await state.ctx.resume(); return; }
  state.ctx = new AudioContext({ sampleRate: RATE, latencyHint: "interactive" });
  await state.ctx.audioWorklet.addModule("/web/player-worklet.js");
  state.node = new AudioWorkletNode(state.ctx, "cadence-player", { outputChannelCount: [1] });
  state.node.connect(state.ctx.destination);
  state.node.port.onmessage = (event) => onWorklet(event.data);
  await state.ctx.resume();
  $("latency").textContent = `${Math.round(latencyS() * 1000)} ms`;
}

function onWorklet(msg) {
  if (msg.type === "position") {
    state.position = { uid: msg.uid, played: msg.played, at: msg.at, starving: msg.starving };
    state.underruns = msg.underruns;
    state.buffered = msg.buffered;
  } else if (msg.type === "finished" && state.current && msg.uid === state.current.uid) {
    state.position = { uid: msg.uid, played: msg.played, at: state.ctx.currentTime };
    state.current.finished = true;
    note("finished", { uid: msg.uid });
    setIdle();
  } else if (msg.type === "stopped") {
    const resolve = state.stopWaiters.get(msg.id);
    state.stopWaiters.delete(msg.id);
    if (resolve) resolve(msg);
  }
}

// What the listener has heard of the current utterance (ms): frames rendered, extrapolated on the
// audio clock since the worklet's last report, minus the output latency.
function heardMs() {
  const cur = state.current;
  if (!cur) return 0;
  let ms = cur.heardMs || 0;
  if (state.position.uid === cur.uid && state.ctx) {
    // no extrapolation while the worklet runs dry: it renders nothing until more audio arrives
    const since = state.position.starving ? 0 : Math.max(0, state.ctx.currentTime - state.position.at);
    const rendered = Math.min(state.position.played + since * RATE, cur.received);
    ms = Math.max(ms, (rendered - latencyS() * RATE) * 1000 / RATE);
  } else if (cur.finished) {
    ms = Math.max(ms, cur.receivedMs);
  }
  cur.heardMs = ms; // the listener's clock never runs backwards, whatever the report jitter
  return ms;
}

function workletStop() {
  const id = state.nextStop++;
  return new Promise((resolve) => {
    state.stopWaiters.set(id, resolve);
    state.node.port.postMessage({ type: "stop", id });
  });
}

// -- the socket ----------------------------------------------------------------------------------
function connect() {
  if (state.ws && state.ws.readyState <= 1) return state.session;
  const token = new URLSearchParams(location.search).get("token");
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(`${scheme}//${location.host}/v1/stream${token ? `?token=${encodeURIComponent(token)}` : ""}`);
  ws.binaryType = "arraybuffer";
  state.ws = ws;
  state.session = new Promise((resolve, reject) => {
    ws.onopen = () => {
      const start = { type: "session.start", language: $("language").value, timestamps: "word",
        output: { encoding: "pcm_f32le", sample_rate: RATE, packet_ms: 20 } };
      if ($("voice").value) start.voice = $("voice").value;
      ws.send(JSON.stringify(start));
    };
    ws.onmessage = (event) => {
      if (typeof event.data === "string") {
        const msg = JSON.parse(event.data);
        if (msg.type === "session.started") { setStatus("open", `connected: ${msg.engine.name}`); resolve(msg); }
        onMessage(msg);
      } else {
        onPacket(event.data);
      }
    };
    ws.onclose = (event) => { setStatus("error", `closed (${event.code})`); reject(new Error("closed")); };
  });
  return state.session;
}

function onPacket(buffer) {
  const view = new DataView(buffer);
  const flags = view.getUint8(1);
  const stream = view.getUint16(2, true);
  const uid = state.streams.get(stream);
  const cur = state.current;
  if (!cur || uid !== cur.uid || cur.interrupted) return; // a cancelled stream's stragglers
  const samples = new Float32Array(buffer.slice(12));
  state.packets += 1;
  if (cur.ttfaMs === null) {
    if (cur.queued) setStatus("open", "admitted"); // it waited in the server's queue until now
    cur.ttfaMs = performance.now() - cur.sentAt;
    $("ttfa").textContent = `${Math.round(cur.ttfaMs)} ms`;
  }
  cur.received += samples.length;
  cur.receivedMs = cur.received * 1000 / RATE;
  state.node.port.postMessage({ type: "push", uid, samples, last: (flags & 1) === 1 }, [samples.buffer]);
}

function onMessage(msg) {
  const cur = state.current;
  note(msg.type, { uid: msg.utterance_id });
  if (msg.type === "utterance.started") {
    state.streams.set(msg.stream, msg.utterance_id);
  } else if (msg.type === "utterance.queued" && cur && msg.utterance_id === cur.uid) {
    // the server is at capacity: the audio comes once the utterance is admitted
    cur.queued = msg;
    setStatus("queued", `queued: position ${msg.position}, about ${(msg.expected_wait_ms / 1000).toFixed(1)} s`);
  } else if (msg.type === "words" && cur && msg.utterance_id === cur.uid) {
    cur.words.push(...msg.words);
    renderWords();
  } else if (msg.type === "utterance.done" && cur && msg.utterance_id === cur.uid) {
    cur.done = msg;
  } else if (msg.type === "utterance.interrupted" && cur && msg.utterance_id === cur.uid) {
    cur.interruptReport = msg;
    if (cur.paused) { // the server's pause timeout came first
      clearTimeout(cur.paused.timer);
      cur.interrupted = { reason: "pause timeout", playedMs: msg.played_ms, highlighted: wordAt(msg.played_ms) };
      cur.paused = null;
      workletStop();
      $("barge").textContent = "Barge in";
      setIdle();
    }
    showInterrupt(msg, "Interrupted");
  } else if (msg.type === "utterance.paused" && cur && msg.utterance_id === cur.uid) {
    cur.pauseReport = msg;
    showInterrupt(msg, "Paused: resuming unless you go on speaking");
  } else if (msg.type === "error") {
    setStatus("error", `${msg.code}: ${msg.message}`);
  }
}

// -- speaking ------------------------------------------------------------------------------------
async function speak() {
  await ensureAudio();
  if (state.current && !state.current.finished && !state.current.interrupted) await bargeIn("new text", false);
  await connect();
  const text = $("text").value;
  const uid = `u${state.nextId++}`;
  state.current = { uid, text, words: [], sentAt: performance.now(), ttfaMs: null, received: 0, receivedMs: 0,
    highlighted: -1, highlightLog: [], heardMs: 0, finished: false, interrupted: null, interruptReport: null, done: null,
    paused: null, pauseReport: null };
  state.node.port.postMessage({ type: "start", uid, prebufferMs: PREBUFFER_MS });
  $("interrupt").hidden = true;
  $("ttfa").textContent = "…";
  $("barge").disabled = false;
  renderWords();
  note("speak", { uid });
  if ($("stream-llm").checked) {
    for (const token of llmTokens(text)) {
      send({ type: "speak.append", utterance_id: uid, text: token });
      await new Promise((r) => setTimeout(r, 30));
      if (state.current.uid !== uid || state.current.interrupted) return;
    }
  } else {
    send({ type: "speak.append", utterance_id: uid, text });
  }
  send({ type: "speak.end", utterance_id: uid });
}

// Pieces of about the size an LLM streams: words, long words cut in three-to-four-letter parts.
function llmTokens(text) {
  const out = [];
  for (const piece of text.match(/\s*\S+/g) || []) {
    for (let i = 0; i < piece.length; i += 4) out.push(piece.slice(i, i + 4));
  }
  return out;
}

function playedMsOf(stopped, cur) {
  const frames = stopped.uid === cur.uid ? stopped.played : 0;
  return Math.max(0, Math.round((frames - latencyS() * RATE) * 1000 / RATE));
}

async function bargeIn(reason, mayPause = true) {
  const cur = state.current;
  if (!cur || cur.finished || cur.interrupted) return;
  if (cur.paused) { await interruptPaused(reason); return; }
  if (mayPause && $("pause-barge").checked) { await pauseFor(reason); return; }
  const playedMs = playedMsOf(await workletStop(), cur);
  const index = wordAt(playedMs);
  cur.interrupted = { reason, playedMs, highlighted: index, word: index >= 0 ? cur.words[index].text : null };
  note("barge-in", { uid: cur.uid, playedMs, highlighted: index });
  send({ type: "speak.cancel", utterance_id: cur.uid, played_ms: playedMs });
  setIdle();
  renderWords();
}

// -- a possible false interruption: pause, then resume unless speech follows ------------------------
async function pauseFor(reason) {
  const cur = state.current;
  const stopped = await new Promise((resolve) => {
    const id = state.nextStop++;
    state.stopWaiters.set(id, resolve);
    state.node.port.postMessage({ type: "pause", id });
  });
  const playedMs = playedMsOf(stopped, cur);
  state.position = { uid: cur.uid, played: stopped.played, at: stopped.at, starving: true }; // frozen
  cur.heardMs = playedMs;
  cur.paused = { reason, playedMs, speechMs: 0, timer: null };
  note("pause", { uid: cur.uid, playedMs });
  send({ type: "speak.pause", utterance_id: cur.uid, played_ms: playedMs });
  $("barge").textContent = "Interrupt";
  armResume();
}

function armResume() {
  const cur = state.current;
  clearTimeout(cur.paused.timer);
  cur.paused.timer = setTimeout(() => resumeAfterFalseInterruption(cur), state.falseInterruption.resumeMs);
}

function speechWhilePaused(ms) { // the microphone heard the listener while paused
  const cur = state.current;
  cur.paused.speechMs += ms;
  if (cur.paused.speechMs >= state.falseInterruption.confirmMs) interruptPaused("speech");
  else armResume();
}

function resumeAfterFalseInterruption(cur) {
  if (state.current !== cur || !cur.paused || cur.interrupted) return;
  clearTimeout(cur.paused.timer);
  cur.paused = null;
  note("unpause", { uid: cur.uid });
  send({ type: "speak.unpause", utterance_id: cur.uid });
  state.position = { ...state.position, at: state.ctx.currentTime, starving: false };
  state.node.port.postMessage({ type: "resume" });
  $("barge").textContent = "Barge in";
}

async function interruptPaused(reason) {
  const cur = state.current;
  const playedMs = cur.paused.playedMs;
  clearTimeout(cur.paused.timer);
  cur.paused = null;
  await workletStop();
  const index = wordAt(playedMs);
  cur.interrupted = { reason, playedMs, highlighted: index, word: index >= 0 ? cur.words[index].text : null };
  note("barge-in", { uid: cur.uid, playedMs, highlighted: index });
  send({ type: "speak.cancel", utterance_id: cur.uid, played_ms: playedMs });
  $("barge").textContent = "Barge in";
  setIdle();
  renderWords();
}

function send(message) { state.ws.send(JSON.stringify(message)); }

// -- words on the playback clock -----------------------------------------------------------------
function wordAt(ms) {
  const words = state.current ? state.current.words : [];
  let index = -1;
  for (let i = 0; i < words.length; i++) if (words[i].start_ms <= ms) index = i;
  return index;
}

function escapeHtml(s) { return s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]); }

function renderWords() {
  const cur = state.current;
  if (!cur) return;
  const words = [...cur.words].sort((a, b) => a.char_start - b.char_start);
  const cut = cur.interrupted ? cur.interrupted.highlighted : Infinity;
  let html = "";
  let at = 0;
  for (const w of words) {
    html += escapeHtml(cur.text.slice(at, w.char_start));
    const classes = ["word"];
    if (w.index < cur.highlighted) classes.push("heard");
    if (w.index === cur.highlighted) classes.push("current");
    if (w.index > cut) classes.push("cut");
    html += `<span class="${classes.join(" ")}" data-index="${w.index}">${escapeHtml(cur.text.slice(w.char_start, w.char_end))}</span>`;
    at = w.char_end;
  }
  $("words").innerHTML = html + escapeHtml(cur.text.slice(at));
}

function tick() {
  const cur = state.current;
  if (cur && !cur.interrupted) {
    const ms = heardMs();
    const index = cur.received > 0 ? wordAt(ms) : -1;
    // forward only: the clock between reports is an estimate, and a pause sets it back to the
    // worklet's exact position, which a highlight already past it must not flicker back to
    if (index > cur.highlighted) {
      // a late tick passes several words at once: each was heard, so each is logged
      for (let passed = Math.max(0, cur.highlighted + 1); passed <= index; passed++) {
        cur.highlightLog.push({ index: passed, ms: Math.round(ms) });
      }
      cur.highlighted = index;
      renderWords();
    }
    $("played").textContent = `${Math.round(ms)} ms`;
  }
  $("underruns").textContent = String(state.underruns);
  $("packets").textContent = String(state.packets);
  $("buffered").textContent = `${Math.round(state.buffered * 1000 / RATE)} ms`;
}

function report() {
  const cur = state.current;
  if (!cur || cur.interrupted || cur.paused || cur.finished || cur.received === 0 || !state.ws || state.ws.readyState !== 1) return;
  send({ type: "playback.report", utterance_id: cur.uid, played_ms: Math.round(heardMs()) });
}

function showInterrupt(msg, title) {
  $("interrupt").hidden = false;
  $("interrupt-title").textContent = title;
  $("last-word").textContent = msg.last_word ? msg.last_word.text : "(none)";
  $("partial-word").textContent = msg.partial_word ? `(cut in “${msg.partial_word.text}”)` : "";
  $("spoken-text").textContent = msg.spoken_text;
  $("unspoken-text").textContent = msg.unspoken_text;
  $("interrupt-ms").textContent = String(msg.played_ms);
  $("interrupt-source").textContent = msg.position_source;
}

function setStatus(kind, text) { $("status").dataset.state = kind; $("status").textContent = text; }
function setIdle() { $("barge").disabled = true; }

// -- microphone barge-in: RMS energy above a threshold for a while (state.mic) ---------------------
let micTimer = null;
async function toggleMic(on) {
  if (!on) { clearInterval(micTimer); micTimer = null; return; }
  await ensureAudio();
  const stream = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true } });
  const analyser = state.ctx.createAnalyser();
  analyser.fftSize = 512;
  state.ctx.createMediaStreamSource(stream).connect(analyser);
  const data = new Float32Array(analyser.fftSize);
  let loudMs = 0;
  micTimer = setInterval(() => {
    analyser.getFloatTimeDomainData(data);
    const rms = Math.sqrt(data.reduce((s, x) => s + x * x, 0) / data.length);
    const loud = 20 * Math.log10(rms + 1e-9) > state.mic.thresholdDbfs;
    loudMs = loud ? loudMs + 20 : 0;
    const cur = state.current;
    if (!cur || cur.finished || cur.interrupted) return;
    if (cur.paused) { if (loud) speechWhilePaused(20); return; }
    if (loudMs >= state.mic.attackMs) bargeIn("microphone");
  }, 20);
}

// -- start-up --------------------------------------------------------------------------------------
async function loadVoices() {
  try {
    const token = new URLSearchParams(location.search).get("token");
    const response = await fetch("/v1/voices", token ? { headers: { Authorization: `Bearer ${token}` } } : {});
    if (!response.ok) return;
    const body = await response.json();
    // the engine's presets, then the voices registered with POST /v1/voices
    const groups = [
      ["Engine presets", (body.presets || []).map((name) => [name, name])],
      ["Registered voices", (body.voices || []).map((v) => [v.name || v.voice_id || v.id, v.voice_id || v.id || v.name])],
    ];
    for (const [label, voices] of groups) {
      if (!voices.length) continue;
      const group = document.createElement("optgroup");
      group.label = label;
      for (const [name, id] of voices) group.append(new Option(name, id));
      $("voice").append(group);
    }
  } catch (e) { /* the voice list is optional */ }
}

// -- the server's live load (GET /v1/load, every second) -----------------------------------------------
const fmtMs = (v) => (typeof v === "number" && Number.isFinite(v) ? `${Math.round(v)} ms` : "–");
const fmtNum = (v) => (typeof v === "number" && Number.isFinite(v) ? `${Math.round(v * 10) / 10}` : "–");

function showLoad(body) {
  const e = body.engine, g = body.gateway, f = e.figures || {};
  state.loadUnavailable = null;
  $("load-panel").dataset.state = "live";
  $("load-unavailable").hidden = true;
  $("load-unavailable").textContent = "";
  $("load-ttfa").textContent = fmtMs(g.ttfa_p50_ms);
  $("load-engine-ttfa").textContent = fmtMs(f.ttfa_p50_ms);
  $("load-active").textContent = `${e.active} / ${e.capacity}`;
  $("load-queued").textContent = `${e.queued}`;
  const a = e.admission; // admission by measured cost: capacity within the bound, the queue, refusals
  $("load-capacity").textContent = a ? `${a.capacity} / ${a.max_streams}` : `${e.capacity}`;
  $("load-queue").textContent = a ? `${a.queued} / ${a.queue_limit}` : `${e.queued} / ${e.queue_limit}`;
  $("load-queue-wait").textContent = a ? `${fmtMs(a.queue_wait_p50_ms)} / ${fmtMs(a.queue_wait_p90_ms)}` : "–";
  $("load-refused").textContent = a ? ["queue_full", "max_wait", "wait_expired"].map((k) => `${a.refused[k] || 0}`).join(" / ") : "–";
  $("load-kv").textContent = "kv_blocks_in_use" in f ? `${f.kv_blocks_in_use} / ${f.kv_blocks_total}` : "–";
  $("load-batch").textContent = ["batch_decode", "batch_prefill", "batch_codec"].map((k) => fmtNum(f[k])).join(" / ");
  $("load-step").textContent = ["step_ms_decode", "step_ms_prefill", "step_ms_codec"].map((k) => fmtNum(f[k])).join(" / ") + " ms";
  $("load-sessions").textContent = `${g.sessions} / ${g.utterances}`;
  $("load-updated").textContent = new Date().toLocaleTimeString();
}

// No current figures (503 engine_unavailable while the engine cannot report its load, another
// refusal, or no answer): the last ones are cleared rather than shown as if current, and the panel
// says why until an answer with figures comes.
function showLoadUnavailable(text) {
  state.load = null;
  state.loadUnavailable = text;
  $("load-panel").dataset.state = "unavailable";
  for (const dd of $("load-panel").querySelectorAll("dd")) dd.textContent = "–";
  $("load-unavailable").textContent = text;
  $("load-unavailable").hidden = false;
  $("load-updated").textContent = new Date().toLocaleTimeString();
}

async function pollLoad() {
  let response;
  try {
    const token = new URLSearchParams(location.search).get("token");
    response = await fetch("/v1/load", token ? { headers: { Authorization: `Bearer ${token}` } } : {});
  } catch (e) {
    showLoadUnavailable("Server unreachable");
    return;
  }
  let body = null;
  try { body = await response.json(); } catch (e) { /* not JSON: the status says enough */ }
  if (response.ok && body && body.engine) {
    state.load = body;
    state.loadPolls = (state.loadPolls || 0) + 1;
    showLoad(body);
    return;
  }
  const error = (body && typeof body.error === "object" && body.error) || {};
  const detail = typeof error.message === "string" ? `: ${error.message}` : "";
  showLoadUnavailable(error.code === "engine_unavailable"
    ? `Engine unavailable${detail}`
    : `Server answered ${response.status}${detail}`);
}

for (const language of LANGUAGES) $("language").add(new Option(language, language));
$("speak").addEventListener("click", () => speak());
$("barge").addEventListener("click", () => bargeIn("button"));
$("mic-barge").addEventListener("change", (e) => toggleMic(e.target.checked));
for (const id of ["voice", "language"]) $(id).addEventListener("change", () => { if (state.ws) state.ws.close(); });
setInterval(tick, 20);
setInterval(report, 100);
loadVoices();
pollLoad();
setInterval(pollLoad, 1000);

window.cadence = { state, heardMs, bargeIn, speak, wordAt };
