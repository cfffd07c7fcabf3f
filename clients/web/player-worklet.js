// Cadence playback worklet: a ring buffer played at the audio clock. An utterance starts once
// `prebufferMs` of it has arrived (or all of it), then packets are played as they arrive; running
// dry mid-utterance counts one underrun. Every ~100 ms it posts how many frames of
// the current utterance it has rendered (and the audio clock then); `stop` answers with the exact
// count and empties the buffer (the barge-in); `pause` answers the same way but keeps the buffer,
// and `resume` plays on from the next frame (a false interruption).
class CadencePlayer extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ring = new Float32Array(sampleRate * 120);
    this.read = 0; // absolute frame counters; index = counter % ring.length
    this.write = 0;
    this.uid = null;
    this.played = 0;
    this.received = 0;
    this.ended = false;
    this.finished = false;
    this.starving = false;
    this.underruns = 0;
    this.sinceReport = 0;
    this.prebuffer = 0; // frames to gather before an utterance starts playing
    this.playing = false;
    this.paused = false;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(msg) {
    if (msg.type === "start") {
      this.read = this.write;
      Object.assign(this, { uid: msg.uid, played: 0, received: 0, ended: false, finished: false, starving: false,
        playing: false, paused: false, prebuffer: Math.round(((msg.prebufferMs ?? 60) * sampleRate) / 1000) });
    } else if (msg.type === "push" && msg.uid === this.uid) {
      const samples = msg.samples;
      const room = this.ring.length - (this.write - this.read);
      const n = Math.min(samples.length, room);
      for (let i = 0; i < n; i++) this.ring[(this.write + i) % this.ring.length] = samples[i];
      this.write += n;
      this.received += n;
      if (msg.last) this.ended = true;
    } else if (msg.type === "stop") {
      this.port.postMessage({ type: "stopped", id: msg.id, uid: this.uid, played: this.played, at: currentTime });
      this.read = this.write;
      this.uid = null;
      this.paused = false;
    } else if (msg.type === "pause") {
      this.paused = true;
      this.port.postMessage({ type: "stopped", id: msg.id, uid: this.uid, played: this.played, at: currentTime });
    } else if (msg.type === "resume") {
      this.paused = false;
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    const n = out.length;
    const available = this.write - this.read;
    if (!this.playing && this.uid !== null && (available >= this.prebuffer || this.ended)) this.playing = true;
    const take = this.playing && this.uid !== null && !this.paused ? Math.min(n, available) : 0;
    for (let i = 0; i < take; i++) out[i] = this.ring[(this.read + i) % this.ring.length];
    out.fill(0, take);
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    this.read += take;
    this.played += take;
    if (this.playing && !this.paused && take < n && !this.ended) {
      if (!this.starving) this.underruns += 1;
      this.starving = true;
    } else if (take === n) {
      this.starving = false;
    }
    this.sinceReport += n;
    const done = this.uid !== null && this.ended && this.write === this.read && !this.finished;
    if (this.sinceReport >= sampleRate / 10 || done) {
      this.sinceReport = 0;
      this.port.postMessage({
        type: "position", uid: this.uid, played: this.played, at: currentTime,
        underruns: this.underruns, buffered: this.write - this.read, starving: this.starving || this.paused,
      });
    }
    if (done) {
      this.finished = true;
      this.port.postMessage({ type: "finished", uid: this.uid, played: this.played });
    }
    return true;
  }
}

registerProcessor("cadence-player", CadencePlayer);
