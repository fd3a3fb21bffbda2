// chatplane's web chat page. Plain JavaScript modules; docs/edge.md, "The web page".
//
// One turn, as the seed's client rules say:
// - a new message gets a fresh Idempotency-Key; a request that got no response at all is sent again
//   with the same key (bounded), so a lost answer never spends a second message: the ledger answers
//   the retry with the same generation (generation_in_progress with its id while it runs, which the
//   page then follows through the events endpoint);
// - a stream that broke after its headers keeps its partial text, marked incomplete, and resumes from
//   the last event id on GET /v1/generations/{id}/events (bounded attempts);
// - Stop calls the cancel endpoint; "stopped" shows only once the server confirms it;
// - an answer that ended in error, was stopped or was cut off offers Regenerate: a new request with a
//   new key (in a conversation: regenerate: true), never appended to the partial answer;
// - refusals by code: quota_exhausted shows the reset time and never retries by itself;
//   rate_limited, concurrency_limited, capacity_exhausted (and quota_service_unavailable, store_unavailable) wait the
//   advised Retry-After with jitter, within a bounded budget, then offer Retry.

import { readEvents } from "./sse.js";
import { renderMarkdown } from "./markdown.js";

// Named bounds (every retry and wait is bounded).
export const LIMITS = {
  noResponseRetriesMax: 3, // sends of the same key after "no response at all"
  noResponseBackoffMs: 300, // doubled per retry, with jitter
  refusalRetriesMax: 4, // automatic waits after a retryable refusal
  refusalWaitBudgetMs: 30_000, // total time spent waiting on Retry-After before offering Retry
  resumeAttemptsMax: 5, // reconnects of one broken stream
  resumeBackoffMs: 500,
  maxOutputTokens: 512,
  historyPage: 50, // messages per range read
  conversationsPage: 50,
};

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "chatplane.token";
const state = {
  token: null,
  user: "",
  models: [],
  history: true, // false when the conversation store is unavailable: stateless turns
  conversations: [],
  // Conversations this page created that the store's list has not shown yet: the list is written from
  // the log by the history writer and can lag it, so these stay at the top of the sidebar until it
  // shows them (at most LIMITS.conversationsPage).
  unlisted: [],
  conversation: null, // {id, revision, title}
  earlierBefore: null,
  turns: [], // {role, text, status, el}
  active: null, // the turn being generated
};

function newKey() {
  if (globalThis.crypto && crypto.randomUUID) return crypto.randomUUID();
  const b = new Uint8Array(16);
  crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const jitter = (ms) => ms * (1 + Math.random() * 0.5);

class Refusal extends Error {
  constructor(status, body, retryAfterS) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || "unknown";
    this.details = err.details || {};
    this.retryable = Boolean(err.retryable);
    this.retryAfterS = retryAfterS;
    // Codes about an existing generation name it beside the details (docs/edge.md, "Errors").
    this.generationId = err.generation_id || this.details.generation_id || null;
    // generation_in_progress: whether the running generation is this key's own (a retry's answer).
    this.sameRequest = err.same_request === true;
  }
}

async function api(method, path, { body, key, headers = {}, signal, keepalive } = {}) {
  const h = { ...headers };
  if (state.token) h.Authorization = `Bearer ${state.token}`;
  if (body !== undefined) h["Content-Type"] = "application/json";
  if (key) h["Idempotency-Key"] = key;
  const resp = await fetch(path, {
    method, headers: h, body: body === undefined ? undefined : JSON.stringify(body), signal, keepalive,
    cache: "no-store",
  });
  if (resp.status === 401 && state.token) {
    signOut("Your session ended; sign in again.");
  }
  return resp;
}

async function refusalOf(resp) {
  let body = null;
  try {
    body = await resp.json();
  } catch {
    body = null;
  }
  const ra = Number(resp.headers.get("Retry-After"));
  return new Refusal(resp.status, body, Number.isFinite(ra) && ra > 0 ? ra : 1);
}

async function json(method, path, opts) {
  const resp = await api(method, path, opts);
  if (!resp.ok) throw await refusalOf(resp);
  return resp.status === 204 ? null : resp.json();
}

function notice(text) {
  const n = $("notice");
  n.textContent = text || "";
  n.hidden = !text;
}

function localTime(iso) {
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? iso : d.toLocaleString([], { weekday: "short", hour: "2-digit", minute: "2-digit" });
}

// ---- sign-in ------------------------------------------------------------------------------

async function showSignIn(message) {
  $("app").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = message || "";
  let dev = false;
  try {
    dev = (await fetch("/dev", { cache: "no-store" })).ok;
  } catch {
    dev = false;
  }
  $("signin-dev").hidden = !dev;
  $("signin-token").hidden = dev;
  $("signin-user").required = dev;
  $("signin-token-value").required = !dev;
  $("signin-form").dataset.mode = dev ? "dev" : "token";
  (dev ? $("signin-user") : $("signin-token-value")).focus();
}

async function signIn(ev) {
  ev.preventDefault();
  $("signin-error").textContent = "";
  try {
    if ($("signin-form").dataset.mode === "dev") {
      const resp = await fetch("/dev/token", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ user: $("signin-user").value.trim(), tier: $("signin-tier").value }),
      });
      if (!resp.ok) throw await refusalOf(resp);
      state.token = (await resp.json()).token;
    } else {
      state.token = $("signin-token-value").value.trim();
    }
    sessionStorage.setItem(TOKEN_KEY, state.token);
    await start();
  } catch (e) {
    state.token = null;
    $("signin-error").textContent = e.message;
  }
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  showSignIn(message);
}

function claims(token) {
  try {
    const part = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
    return JSON.parse(atob(part + "===".slice((part.length + 3) % 4)));
  } catch {
    return {};
  }
}

// ---- usage, models, conversations ---------------------------------------------------------

async function refreshUsage() {
  try {
    const u = await json("GET", "/v1/usage");
    const q = u.quota;
    $("usage").textContent = `${q.remaining} of ${q.limit} messages left · resets ${localTime(q.reset_at)}`;
    $("usage").dataset.remaining = String(q.remaining);
    $("usage").dataset.used = String(q.used);
    $("usage").dataset.resetAt = q.reset_at;
  } catch (e) {
    $("usage").textContent = "";
  }
}

async function loadModels() {
  const doc = await json("GET", "/v1/models");
  state.models = doc.data.map((m) => m.id);
  const sel = $("model");
  sel.replaceChildren(...state.models.map((id) => Object.assign(document.createElement("option"), { value: id, textContent: id })));
  const saved = localStorage.getItem("chatplane.model");
  if (saved && state.models.includes(saved)) sel.value = saved;
}

async function loadConversations() {
  try {
    const doc = await json("GET", `/v1/conversations?limit=${LIMITS.conversationsPage}`);
    state.history = true;
    const listed = new Set(doc.data.map((c) => c.id));
    state.unlisted = state.unlisted.filter((c) => !listed.has(c.id));
    state.conversations = [...state.unlisted, ...doc.data];
    $("history-note").hidden = true;
  } catch (e) {
    if (e instanceof Refusal && e.code === "history_unavailable") {
      state.history = false;
      $("history-note").textContent = "History is unavailable right now: new chats are not saved.";
      $("history-note").hidden = false;
      state.conversations = [];
    } else {
      throw e;
    }
  }
  renderConversations();
}

function renderConversations() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of state.conversations) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (state.conversation && state.conversation.id === c.id) li.className = "active";
    const a = document.createElement("a");
    a.textContent = c.title || "Untitled";
    a.title = c.title || "";
    a.addEventListener("click", () => openConversation(c.id));
    const del = document.createElement("button");
    del.type = "button";
    del.textContent = "\u2715";
    del.setAttribute("aria-label", "Delete conversation");
    del.addEventListener("click", () => deleteConversation(c.id));
    li.append(a, del);
    ul.appendChild(li);
  }
}

function clearMessages() {
  state.turns = [];
  const box = $("messages");
  box.replaceChildren($("load-earlier"));
  $("load-earlier").hidden = true;
}

function newChat() {
  if (state.active) return;
  state.conversation = null;
  state.earlierBefore = null;
  clearMessages();
  notice("");
  renderConversations();
  $("prompt").focus();
}

async function openConversation(id) {
  if (state.active) return;
  notice("");
  clearMessages();
  try {
    const conv = await json("GET", `/v1/conversations/${encodeURIComponent(id)}`);
    state.conversation = { id: conv.id, revision: conv.revision, title: conv.title };
    const page = await json("GET", `/v1/conversations/${encodeURIComponent(id)}/messages?order=desc&limit=${LIMITS.historyPage}`);
    state.conversation.revision = page.revision;
    for (const m of page.data.slice().reverse()) appendStored(m);
    state.earlierBefore = page.next_after;
    $("load-earlier").hidden = page.next_after === null;
  } catch (e) {
    notice(e.message);
  }
  renderConversations();
  $("app").classList.remove("sidebar-open");
}

async function loadEarlier() {
  if (!state.conversation || state.earlierBefore === null) return;
  const id = state.conversation.id;
  const page = await json("GET", `/v1/conversations/${encodeURIComponent(id)}/messages?before=${state.earlierBefore}&limit=${LIMITS.historyPage}`);
  const box = $("messages");
  const anchor = $("load-earlier").nextSibling;
  for (const m of page.data.slice().reverse()) {
    const turn = makeTurn(m.role, m.content, m.status === "completed" ? "completed" : "incomplete");
    box.insertBefore(turn.el, anchor);
    state.turns.unshift(turn);
  }
  state.earlierBefore = page.next_after;
  $("load-earlier").hidden = page.next_after === null;
}

async function deleteConversation(id) {
  if (state.active) return;
  if (!window.confirm("Delete this conversation and all of its messages?")) return;
  try {
    await json("DELETE", `/v1/conversations/${encodeURIComponent(id)}`);
  } catch (e) {
    notice(e.message);
    return;
  }
  state.unlisted = state.unlisted.filter((c) => c.id !== id);
  if (state.conversation && state.conversation.id === id) newChat();
  await loadConversations();
}

// ---- messages -----------------------------------------------------------------------------

function makeTurn(role, text, status) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  const st = document.createElement("div");
  st.className = "state";
  el.append(body, st);
  const turn = { role, text: text || "", status, el, body, stateEl: st, lastId: -1, renderQueued: false };
  paint(turn);
  setStatus(turn, status);
  return turn;
}

function appendStored(m) {
  const turn = makeTurn(m.role, m.content, m.status === "completed" ? "completed" : "incomplete");
  turn.generationId = m.generation_id;
  $("messages").appendChild(turn.el);
  state.turns.push(turn);
  if (m.role === "assistant" && m.status !== "completed") offerRegenerate(turn, "incomplete");
}

function paint(turn) {
  if (turn.role === "assistant") renderMarkdown(turn.body, turn.text);
  else turn.body.textContent = turn.text;
}

function schedulePaint(turn) {
  if (turn.renderQueued) return;
  turn.renderQueued = true;
  requestAnimationFrame(() => {
    turn.renderQueued = false;
    paint(turn);
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  });
}

const STATUS_TEXT = {
  waiting: "waiting…", streaming: "", completed: "", stopping: "stopping…", stopped: "stopped",
  incomplete: "incomplete", error: "failed", refused: "not sent", resuming: "connection lost: resuming…",
};

function setStatus(turn, status, detail) {
  turn.status = status;
  turn.el.dataset.status = status;
  turn.stateEl.replaceChildren();
  const text = detail || STATUS_TEXT[status] || "";
  if (text) {
    const span = document.createElement("span");
    span.className = "state-text";
    span.textContent = text;
    turn.stateEl.appendChild(span);
  }
}

function addAction(turn, label, cls, fn) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = `link ${cls}`;
  b.textContent = label;
  b.addEventListener("click", () => {
    if (state.active) return;
    fn();
  });
  turn.stateEl.appendChild(b);
}

function offerRegenerate(turn, status, detail) {
  setStatus(turn, status, detail);
  addAction(turn, "Regenerate", "regenerate", () => regenerate(turn));
}

function setBusy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("stop").disabled = false;
}

// ---- one generation -----------------------------------------------------------------------

function contextFor(upTo) {
  // Stateless turns carry the whole context: completed (or partial) turns before this answer.
  const out = [];
  for (const t of state.turns) {
    if (t === upTo) break;
    if (t.role === "user" || (t.role === "assistant" && t.text)) out.push({ role: t.role, content: t.text });
  }
  return out;
}

async function send(text) {
  if (state.active || !text.trim()) return;
  const t0 = performance.now(); // Enter: the first-token time is what the person waits from here
  notice("");
  const model = $("model").value;
  localStorage.setItem("chatplane.model", model);
  const userTurn = makeTurn("user", text, "completed");
  $("messages").appendChild(userTurn.el);
  state.turns.push(userTurn);
  const answer = makeTurn("assistant", "", "waiting");
  $("messages").appendChild(answer.el);
  state.turns.push(answer);
  $("prompt").value = "";
  const body = { model, stream: true, max_output_tokens: LIMITS.maxOutputTokens };
  if (state.history) {
    try {
      if (!state.conversation) {
        const c = await json("POST", "/v1/conversations", { body: { title: text.trim().slice(0, 80) }, key: newKey() });
        state.conversation = { id: c.id, revision: c.revision, title: c.title };
        state.unlisted = [c, ...state.unlisted].slice(0, LIMITS.conversationsPage);
        state.conversations.unshift(c);
        renderConversations();
      }
    } catch (e) {
      if (!(e instanceof Refusal && e.code === "history_unavailable")) {
        undoTurn(userTurn, answer, text, e.message);
        return;
      }
      state.history = false;
    }
  }
  if (state.history && state.conversation) {
    Object.assign(body, {
      conversation_id: state.conversation.id, expected_revision: state.conversation.revision,
      messages: [{ role: "user", content: text }],
    });
  } else {
    body.messages = contextFor(answer);
  }
  await generate(answer, body, { userTurn, text, t0 });
}

function regenerate(turn) {
  const model = $("model").value;
  turn.text = "";
  turn.lastId = -1;
  paint(turn);
  setStatus(turn, "waiting");
  const body = { model, stream: true, max_output_tokens: LIMITS.maxOutputTokens };
  if (state.history && state.conversation) {
    Object.assign(body, { conversation_id: state.conversation.id, expected_revision: state.conversation.revision, regenerate: true });
  } else {
    body.messages = contextFor(turn);
  }
  return generate(turn, body, {});
}

function undoTurn(userTurn, answer, text, message) {
  // A turn the server never took: its bubbles go, the text goes back into the box.
  for (const t of [userTurn, answer]) {
    t.el.remove();
    state.turns = state.turns.filter((x) => x !== t);
  }
  $("prompt").value = text;
  notice(message);
}

async function generate(turn, body, { userTurn, text, t0 }) {
  const run = {
    turn, body, key: newKey(), generationId: null, t0: t0 === undefined ? performance.now() : t0, firstTokenAt: null, terminal: null,
    stopWanted: false, controller: new AbortController(),
  };
  turn.key = run.key;
  turn.el.dataset.key = run.key;
  state.active = run;
  setBusy(true);
  try {
    await submit(run, { userTurn, text });
  } finally {
    state.active = null;
    setBusy(false);
    await afterTurn();
  }
}

async function afterTurn() {
  await refreshUsage();
  if (state.history && state.conversation) {
    try {
      const c = await json("GET", `/v1/conversations/${encodeURIComponent(state.conversation.id)}`);
      // The store's row can lag the ledger: never step back.
      state.conversation.revision = Math.max(state.conversation.revision, c.revision);
    } catch {
      // the next send learns the revision from a conflict, if it changed
    }
    loadConversations().catch(() => {});
  }
}

async function submit(run, { userTurn, text }) {
  const { turn } = run;
  let noResponse = 0;
  let refusals = 0;
  let waitedMs = 0;
  for (;;) {
    let resp;
    try {
      resp = await api("POST", "/v1/generations", { body: run.body, key: run.key, signal: run.controller.signal });
    } catch (e) {
      if (run.controller.signal.aborted) return;
      // No response at all: the request may or may not have reached the server. The same key makes
      // the retry safe (one generation, one message), so it is sent again, a bounded number of times.
      if (noResponse < LIMITS.noResponseRetriesMax) {
        noResponse += 1;
        setStatus(turn, "waiting", "no response: sending again…");
        await sleep(jitter(LIMITS.noResponseBackoffMs * 2 ** (noResponse - 1)));
        continue;
      }
      setStatus(turn, "error", "no response from the server");
      addAction(turn, "Retry", "retry", () => retrySameKey(run));
      return;
    }
    if (resp.ok) {
      if ((resp.headers.get("Content-Type") || "").startsWith("text/event-stream")) {
        await consume(run, resp);
      } else {
        applyDocument(run, await resp.json());
      }
      return;
    }
    const r = await refusalOf(resp);
    if (r.code === "generation_in_progress" && r.generationId && r.sameRequest) {
      // Our own earlier send reached the server after all (the browser itself may have sent it again
      // on a fresh connection, unseen by this script): follow that generation.
      run.generationId = r.generationId;
      turn.generationId = run.generationId;
      turn.el.dataset.generationId = run.generationId;
      await follow(run);
      return;
    }
    if (r.code === "quota_exhausted") {
      const reset = r.details.reset_at ? ` It resets ${localTime(r.details.reset_at)}.` : "";
      setStatus(turn, "refused", `You have used all ${r.details.limit ?? ""} messages of this window.${reset}`);
      turn.el.dataset.code = r.code;
      if (r.details.reset_at) turn.el.dataset.resetAt = r.details.reset_at;
      return;
    }
    if (["rate_limited", "concurrency_limited", "capacity_exhausted", "quota_service_unavailable", "store_unavailable"].includes(r.code)) {
      const waitMs = jitter(r.retryAfterS * 1000);
      if (refusals < LIMITS.refusalRetriesMax && waitedMs + waitMs <= LIMITS.refusalWaitBudgetMs) {
        refusals += 1;
        waitedMs += waitMs;
        setStatus(turn, "waiting", `${r.message} Trying again in ${Math.ceil(waitMs / 1000)} s…`);
        turn.el.dataset.code = r.code;
        await sleep(waitMs);
        if (run.controller.signal.aborted) return;
        continue;
      }
      setStatus(turn, "refused", r.message);
      turn.el.dataset.code = r.code;
      addAction(turn, "Retry", "retry", () => retrySameKey(run));
      return;
    }
    if (r.code === "conversation_conflict" && userTurn) {
      // Another tab or device moved the conversation on: show what it holds now, give the text back.
      const id = state.conversation.id;
      undoTurn(userTurn, turn, text, "This conversation changed in another tab or device. It has been reloaded; your message is back in the box.");
      const keep = $("prompt").value;
      await openConversation(id);
      $("prompt").value = keep;
      notice("This conversation changed in another tab or device. It has been reloaded; your message is back in the box.");
      return;
    }
    if (r.code === "generation_in_progress" && userTurn) {
      undoTurn(userTurn, turn, text, "An answer in this conversation is still being written (another tab or device). Wait for it, then send again.");
      return;
    }
    setStatus(turn, "refused", r.message);
    turn.el.dataset.code = r.code;
    return;
  }
}

function retrySameKey(run) {
  // The same logical request again (same key): never a second message.
  const { turn } = run;
  setStatus(turn, "waiting");
  run.retried = true;
  run.controller = new AbortController();
  state.active = run;
  setBusy(true);
  submit(run, {}).finally(async () => {
    state.active = null;
    setBusy(false);
    await afterTurn();
  });
}

function applyDocument(run, doc) {
  // A JSON answer (an earlier request's result returned for the same key).
  const { turn } = run;
  run.generationId = doc.id;
  turn.generationId = doc.id;
  turn.el.dataset.generationId = doc.id;
  turn.text = (doc.output || []).map((o) => o.text || "").join("");
  paint(turn);
  finish(run, doc.status === "completed" ? "completed" : doc.status === "cancelled" ? "stopped" : "error");
}

function onEvent(run, ev) {
  const { turn } = run;
  const d = ev.data || {};
  if (ev.id !== null && !Number.isNaN(ev.id)) {
    // Replay after a reconnect starts after the last id seen; anything older is a duplicate.
    if (ev.event === "generation.text.delta" && ev.id <= turn.lastId) return;
    if (ev.id > turn.lastId) turn.lastId = ev.id;
  }
  switch (ev.event) {
    case "generation.created":
      run.generationId = d.generation_id;
      turn.generationId = d.generation_id;
      turn.el.dataset.generationId = d.generation_id;
      if (state.conversation && d.revision !== undefined) {
        state.conversation.revision = Math.max(state.conversation.revision, d.revision);
        run.turnRevision = d.revision;
      }
      if (turn.status === "waiting" || turn.status === "resuming") setStatus(turn, "streaming");
      if (run.stopWanted) stop();
      break;
    case "generation.text.delta":
      turn.text += d.delta || "";
      if (turn.status !== "stopping") setStatus(turn, "streaming");
      schedulePaint(turn);
      if (run.firstTokenAt === null) {
        run.firstTokenAt = 0;
        // After the frame that shows it: what the person saw.
        requestAnimationFrame(() => {
          const ms = performance.now() - run.t0;
          run.firstTokenAt = ms;
          turn.el.dataset.firstTokenMs = ms.toFixed(1);
          api("POST", "/v1/client-metrics", { body: { first_token_ms: Math.round(ms * 10) / 10 }, keepalive: true }).catch(() => {});
        });
      }
      break;
    case "generation.completed":
      run.terminal = "completed";
      run.nextRevision = d.next_expected_revision;
      break;
    case "generation.cancelled":
      run.terminal = "stopped";
      run.nextRevision = d.next_expected_revision;
      break;
    case "generation.error":
      run.terminal = "error";
      run.errorCode = d.code;
      run.nextRevision = d.next_expected_revision;
      break;
    default:
      break;
  }
}

async function consume(run, resp) {
  try {
    await readEvents(resp, (ev) => onEvent(run, ev), run.controller.signal);
  } catch (e) {
    if (run.controller.signal.aborted && !run.terminal) return;
  }
  if (run.terminal) {
    finish(run, run.terminal);
    return;
  }
  await follow(run);
}

async function follow(run) {
  // Resume from the last event id on any edge: durable replay, then live to the terminal event.
  const { turn } = run;
  for (let attempt = 0; attempt < LIMITS.resumeAttemptsMax && !run.terminal; attempt += 1) {
    if (!run.generationId) {
      // The connection broke before generation.created: ask again with the same key.
      run.retried = true;
      await submit(run, {});
      return;
    }
    setStatus(turn, "resuming");
    if (attempt > 0) await sleep(jitter(LIMITS.resumeBackoffMs * 2 ** (attempt - 1)));
    const headers = turn.lastId >= 0 ? { "Last-Event-ID": String(turn.lastId) } : {};
    let resp;
    try {
      resp = await api("GET", `/v1/generations/${encodeURIComponent(run.generationId)}/events`, { headers, signal: run.controller.signal });
    } catch {
      continue;
    }
    if (!resp.ok) {
      const r = await refusalOf(resp);
      if (r.retryable) {
        await sleep(jitter(r.retryAfterS * 1000));
        continue;
      }
      break;
    }
    try {
      await readEvents(resp, (ev) => onEvent(run, ev), run.controller.signal);
    } catch {
      // broken again: the next attempt goes on from the new last id
    }
  }
  finish(run, run.terminal || "incomplete");
}

function finish(run, outcome) {
  const { turn } = run;
  paint(turn);
  if (outcome !== "incomplete" && state.conversation && run.nextRevision !== undefined) {
    // A turn's terminal event names the revision its next turn sends (its answer's, committed and
    // stored before the event was sent).
    state.conversation.revision = Math.max(state.conversation.revision, run.nextRevision);
  } else if (outcome !== "incomplete" && state.conversation && run.turnRevision !== undefined) {
    // A replay served by an edge that does not know the turn: its answer commits at the next revision.
    state.conversation.revision = Math.max(state.conversation.revision, run.turnRevision + 1);
  }
  if (outcome === "completed") {
    setStatus(turn, "completed");
    return;
  }
  if (outcome === "stopped") {
    offerRegenerate(turn, "stopped");
    return;
  }
  if (outcome === "error") {
    offerRegenerate(turn, "error", `failed${run.errorCode ? ` (${run.errorCode})` : ""}: the text so far is kept`);
    return;
  }
  offerRegenerate(turn, "incomplete", "incomplete: the connection was lost");
}

async function stop() {
  const run = state.active;
  if (!run) return;
  if (!run.generationId) {
    run.stopWanted = true; // sent as soon as generation.created names it
    setStatus(run.turn, "stopping");
    return;
  }
  $("stop").disabled = true;
  setStatus(run.turn, "stopping");
  try {
    const doc = await json("POST", `/v1/generations/${encodeURIComponent(run.generationId)}/cancel`);
    // 202 cancel_requested: the worker is stopping; the stream's generation.cancelled confirms it.
    if (doc && doc.status === "cancelled") run.terminal = "stopped";
    else if (doc && doc.status === "completed") run.terminal = run.terminal || "completed";
  } catch (e) {
    setStatus(run.turn, "streaming", `could not stop: ${e.message}`);
    $("stop").disabled = false;
  }
}

// ---- start --------------------------------------------------------------------------------

async function start() {
  const c = claims(state.token);
  state.user = c.sub || "";
  $("whoami").textContent = state.user;
  $("signin").hidden = true;
  $("app").hidden = false;
  await loadModels();
  await Promise.all([refreshUsage(), loadConversations()]);
  $("prompt").focus();
}

function applyTheme(theme) {
  if (theme) document.documentElement.dataset.theme = theme;
  else delete document.documentElement.dataset.theme;
}

function init() {
  applyTheme(localStorage.getItem("chatplane.theme"));
  $("theme").addEventListener("click", () => {
    const dark = document.documentElement.dataset.theme
      ? document.documentElement.dataset.theme === "dark"
      : matchMedia("(prefers-color-scheme: dark)").matches;
    const next = dark ? "light" : "dark";
    localStorage.setItem("chatplane.theme", next);
    applyTheme(next);
  });
  $("signin-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", () => signOut());
  $("new-chat").addEventListener("click", newChat);
  $("load-earlier").addEventListener("click", () => loadEarlier().catch((e) => notice(e.message)));
  $("toggle-sidebar").addEventListener("click", () => $("app").classList.toggle("sidebar-open"));
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send($("prompt").value);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send($("prompt").value);
    }
  });
  $("stop").addEventListener("click", stop);
  state.token = sessionStorage.getItem(TOKEN_KEY);
  if (state.token) start().catch((e) => signOut(e.message));
  else showSignIn();
}

init();
