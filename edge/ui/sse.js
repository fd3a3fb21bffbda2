// The page's server-sent-event reader: a POST stream read with fetch and a streaming
// reader (EventSource cannot send a body or a bearer header).
//
// Bytes arrive in arbitrary pieces: an event may span many reads and a UTF-8 character may be split
// between two (the test server sends one byte per write). TextDecoder with {stream: true} keeps an
// incomplete character until its last byte arrives; the frame parser keeps an incomplete event until
// its blank line. Lines end in LF, CRLF or CR (the SSE grammar); comments (": keep-alive") are skipped.

// A single event larger than this is a broken stream, not a long answer (deltas are small).
export const EVENT_CHARS_MAX = 1 << 20;

export class SseParser {
  constructor(onEvent) {
    this.onEvent = onEvent;
    this.decoder = new TextDecoder("utf-8");
    this.buffer = "";
    this.reset();
  }

  reset() {
    this.id = null;
    this.event = "";
    this.data = [];
  }

  // Feed one chunk of bytes (a Uint8Array); calls onEvent({id, event, data}) per complete event.
  push(bytes) {
    this.buffer += this.decoder.decode(bytes, { stream: true });
    this.drain();
  }

  // The stream ended: a trailing event without its blank line is incomplete and dropped (the spec).
  end() {
    this.buffer += this.decoder.decode();
    this.drain();
  }

  drain() {
    for (;;) {
      const m = /\r\n|\r|\n/.exec(this.buffer);
      if (m === null) break;
      // A CR at the very end may be the first half of a CRLF split across reads: wait for more.
      if (m[0] === "\r" && m.index === this.buffer.length - 1) break;
      const line = this.buffer.slice(0, m.index);
      this.buffer = this.buffer.slice(m.index + m[0].length);
      this.line(line);
    }
    if (this.buffer.length > EVENT_CHARS_MAX) {
      throw new Error("event too large");
    }
  }

  line(line) {
    if (line === "") {
      if (this.data.length > 0 || this.event) {
        this.onEvent({ id: this.id, event: this.event || "message", data: this.data.join("\n") });
      }
      this.reset();
      return;
    }
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.event = value;
    else if (field === "data") this.data.push(value);
    else if (field === "id") this.id = value;
  }
}

// Read a fetch Response's body as SSE, calling onEvent per event with its data parsed as JSON.
// Resolves when the body ends; rejects when the connection breaks (the caller resumes from the last id).
export async function readEvents(response, onEvent, signal) {
  const reader = response.body.getReader();
  const parser = new SseParser((ev) => {
    let data = null;
    try {
      data = JSON.parse(ev.data);
    } catch {
      data = null;
    }
    onEvent({ id: ev.id === null ? null : Number(ev.id), event: ev.event, data });
  });
  try {
    for (;;) {
      if (signal && signal.aborted) throw new DOMException("aborted", "AbortError");
      const { value, done } = await reader.read();
      if (done) break;
      parser.push(value);
    }
    parser.end();
  } finally {
    reader.releaseLock();
  }
}
