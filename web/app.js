// aioengine chat page: multi-turn chat over the WebSocket API at /v1/ws
// (protocol: docs/websocket.md), conversations kept in this browser, and a live
// engine panel fed by the socket's stats subscription. Plain JavaScript modules,
// no build step, nothing fetched from elsewhere.
//
// Safety: user text reaches the page only as DOM text (textContent); model
// answers only through markdown.js (marked, then DOMPurify, then DOM nodes), and
// their tool calls (tool_calls.js) only as textContent.
// No innerHTML anywhere in the page's own code; Trusted Types enforce that.

import { ConversationStore, CONVERSATIONS_KEY } from "./conversations.js";
import { EnginePanel } from "./engine_panel.js";
import { MarkdownView, copyText, renderMarkdown } from "./markdown.js";
import { ToolCallsView, applyFragments, cleanCalls } from "./tool_calls.js";

const $ = (id) => document.getElementById(id);
const el = {
  messages: $("messages"), empty: $("empty"), composer: $("composer"), prompt: $("prompt"),
  send: $("send"), stop: $("stop"), newChat: $("new-chat"), toggleSide: $("toggle-side"),
  toggleHistory: $("toggle-history"), side: $("side"), history: $("history"),
  convList: $("conv-list"), convNone: $("conv-none"), convWarn: $("conv-warn"),
  system: $("system-prompt"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), conn: $("conn"), connText: $("conn-text"),
  modelName: $("model-name"), authDialog: $("auth-dialog"), authForm: $("auth-form"),
  apiKey: $("api-key"), rememberKey: $("remember-key"), authError: $("auth-error"),
};
const panel = new EnginePanel({
  engine: $("engine"), grid: $("block-grid"), gridScale: $("grid-scale"),
  stat: {
    running: $("stat-running"), waiting: $("stat-waiting"), used: $("stat-blocks-used"),
    total: $("stat-blocks-total"), hitRate: $("stat-hit-rate"),
    preemptions: $("stat-preemptions"), lastStep: $("stat-last-step"),
    spec: $("stat-spec"),
  },
});

const KEY_STORAGE = "aioengine.apiKey";
const SETTINGS_STORAGE = "aioengine.settings";
const RECONNECT_MAX_MS = 5000;
const DELETE_CONFIRM_MS = 4000;

// -- state ----------------------------------------------------------------------------------
const store = new ConversationStore();
const state = {
  ws: null,
  ready: false,             // connected and authenticated
  apiKey: sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || "",
  reconnectDelay: 500,
  reconnectTimer: null,
  current: null,            // the answer being streamed: {id, conv, text, view, md, calls, ...}
  editing: false,           // the last user message is open for editing
  renamingId: null,         // the conversation whose title is being edited
  confirmDeleteId: null,    // a conversation whose delete button asks "Delete?"
  confirmTimer: null,
  nextId: 1,
};

// -- the conversation view ------------------------------------------------------------------

function nearBottom() {
  const m = el.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
}

function scrollToBottom() {
  el.messages.scrollTop = el.messages.scrollHeight;
}

/** A message bubble; `index` is its place in the conversation (none while streaming). */
function addBubble(role, text, index) {
  el.empty.hidden = true;
  const stick = nearBottom();
  const msg = document.createElement("article");
  msg.className = `msg ${role}`;
  if (index !== undefined) msg.dataset.index = String(index);
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Model";
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  const actions = document.createElement("div");
  actions.className = "msg-actions";
  msg.append(who, content, meta, actions);
  if (role === "user") content.textContent = text; else renderMarkdown(content, text);
  el.messages.appendChild(msg);
  if (stick || role === "user") scrollToBottom();
  return { msg, content, meta, actions };
}

function viewOf(msg) {
  return { msg, content: msg.querySelector(".content"), meta: msg.querySelector(".meta"),
    actions: msg.querySelector(".msg-actions") };
}

/** Shows a finished answer's tool calls, each its own element below its text. */
function showToolCalls(view, calls) {
  if (calls && calls.length) new ToolCallsView(view.msg, view.meta).render(calls, true);
}

function fmt(x, digits) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
}

function setMeta(meta, parts, extraClass) {
  meta.replaceChildren();
  for (const [label, value, title] of parts) {
    const span = document.createElement("span");
    if (extraClass && label === "status") span.className = extraClass;
    span.textContent = value;
    if (title) span.title = title;
    span.dataset.k = label;
    meta.appendChild(span);
  }
}

const FINISH_LABEL = { stop: "", tool_calls: "", length: "max tokens reached",
  abort: "stopped" };

/** The figures of a `done` message worth keeping with the answer. */
function doneMeta(done) {
  return { finish_reason: done.finish_reason ?? null, usage: done.usage ?? null,
    ttft_s: done.ttft_s ?? null, tokens_per_s: done.tokens_per_s ?? null };
}

function showDone(view, done) {
  const usage = done.usage || {};
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  const parts = [];
  if (done.usage) {
    parts.push(
      ["ttft", `TTFT ${fmt(done.ttft_s == null ? null : done.ttft_s * 1000, 0)} ms`,
        "time to first token"],
      ["tps", `${fmt(done.tokens_per_s, 1)} tok/s`, "decode speed after the first token"],
      ["completion", `${usage.completion_tokens ?? 0} tokens`, "tokens in this answer"],
      ["prompt", `prompt ${usage.prompt_tokens ?? 0} (${cached} cached)`,
        "prompt tokens, and how many came from the prefix cache"]);
  }
  const label = FINISH_LABEL[done.finish_reason] ?? String(done.finish_reason || "");
  if (label) parts.push(["status", label]);
  setMeta(view.meta, parts, done.finish_reason === "abort" ? "warn" : "");
  view.msg.dataset.finish = done.finish_reason || "";
}

function showError(view, message) {
  view.msg.classList.add("failed");
  setMeta(view.meta, [["status", message]], "err");
}

/** Shows the active conversation (or the empty page for a new chat). */
function renderConversation() {
  for (const node of [...el.messages.querySelectorAll(".msg")]) node.remove();
  state.editing = false;
  const conv = store.active;
  const messages = conv ? conv.messages : [];
  el.empty.hidden = messages.length > 0;
  messages.forEach((m, i) => {
    const view = addBubble(m.role, m.content, i);
    if (m.role === "assistant") showToolCalls(view, m.tool_calls);
    if (m.role === "assistant" && m.meta) showDone(view, m.meta);
  });
  refreshActions();
  scrollToBottom();
}

/** Removes the bubbles after the one for message `index` (all of them for -1). */
function removeBubblesAfter(index) {
  let after = index < 0;
  for (const node of [...el.messages.querySelectorAll(".msg")]) {
    if (after) node.remove();
    else if (node.dataset.index === String(index)) after = true;
  }
}

function actionButton(action, label, title) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "small";
  b.dataset.action = action;
  b.textContent = label;
  if (title) b.title = title;
  return b;
}

// Copy on every answer; Edit on the last question; Regenerate on the last
// answer (Retry on the last question when its answer failed). None while an
// answer streams or the question is being edited.
function refreshActions() {
  const bubbles = [...el.messages.querySelectorAll(".msg")];
  for (const b of bubbles) b.querySelector(".msg-actions").replaceChildren();
  if (state.current || state.editing) return;
  for (const b of bubbles) {
    if (b.classList.contains("assistant") && b.dataset.index !== undefined) {
      b.querySelector(".msg-actions").append(actionButton("copy-answer", "Copy",
        "copy this answer as Markdown"));
    }
  }
  const conv = store.active;
  if (!conv || !conv.messages.length) return;
  const lastUser = conv.messages.map((m) => m.role).lastIndexOf("user");
  if (lastUser < 0) return;
  const userBubble = bubbles.find((b) => b.dataset.index === String(lastUser));
  if (!userBubble) return;
  userBubble.querySelector(".msg-actions").append(actionButton("edit", "Edit",
    "edit this message and send it again"));
  const answerBubble = bubbles[bubbles.indexOf(userBubble) + 1];
  if (answerBubble) {
    answerBubble.querySelector(".msg-actions").append(actionButton("regenerate", "Regenerate",
      "answer the last message again, replacing this answer"));
  } else {
    userBubble.querySelector(".msg-actions").append(actionButton("regenerate", "Retry",
      "answer this message again"));
  }
  updateSendEnabled();
}

// -- the conversation list ------------------------------------------------------------------

function persisted(ok) {
  el.convWarn.hidden = ok;
  el.convWarn.textContent = ok ? ""
    : "This browser did not save the conversation (storage full or turned off).";
  return ok;
}

function renderList() {
  const items = store.list().map((conv) => {
    const li = document.createElement("li");
    li.className = "conv";
    li.dataset.id = conv.id;
    if (conv.id === store.activeId) li.setAttribute("aria-current", "true");
    if (conv.id === state.renamingId) {
      const input = document.createElement("input");
      input.className = "conv-title-input";
      input.value = conv.title;
      input.setAttribute("aria-label", "Conversation title");
      input.maxLength = 200;
      li.append(input);
      return li;
    }
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-open";
    open.textContent = conv.title;
    open.title = conv.title;
    const rename = document.createElement("button");
    rename.type = "button";
    rename.className = "conv-rename icon";
    rename.textContent = "✎";
    rename.setAttribute("aria-label", `Rename “${conv.title}”`);
    const del = document.createElement("button");
    del.type = "button";
    const confirming = conv.id === state.confirmDeleteId;
    del.className = confirming ? "conv-delete icon confirm" : "conv-delete icon";
    del.textContent = confirming ? "Delete?" : "×";
    del.setAttribute("aria-label", confirming ? "Click again to delete"
      : `Delete “${conv.title}”`);
    li.append(open, rename, del);
    return li;
  });
  el.convList.replaceChildren(...items);
  el.convNone.hidden = items.length > 0;
}

function focusInList(id, selector) {
  const li = [...el.convList.children].find((n) => n.dataset.id === id);
  const target = li && li.querySelector(selector);
  if (target) target.focus();
  return target;
}

function switchTo(id) {
  closePanels();
  if (id === store.activeId && !state.current) return;
  abandonCurrent();
  persisted(store.setActive(id));
  renderConversation();
  renderList();
  el.prompt.focus();
}

function startRename(id) {
  state.renamingId = id;
  renderList();
  const input = focusInList(id, ".conv-title-input");
  if (!input) return;
  input.select();
  const finish = (keep) => {
    if (state.renamingId !== id) return;
    state.renamingId = null;
    if (keep) persisted(store.rename(id, input.value));
    renderList();
    focusInList(id, ".conv-rename");
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); finish(true); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }
  });
  input.addEventListener("blur", () => finish(true));
}

function askDelete(id) {
  clearTimeout(state.confirmTimer);
  if (state.confirmDeleteId !== id) {
    state.confirmDeleteId = id;
    renderList();
    focusInList(id, ".conv-delete");
    state.confirmTimer = setTimeout(() => { state.confirmDeleteId = null; renderList(); },
      DELETE_CONFIRM_MS);
    return;
  }
  state.confirmDeleteId = null;
  const wasActive = id === store.activeId;
  if (wasActive) abandonCurrent();
  persisted(store.remove(id));
  if (wasActive) renderConversation();
  renderList();
}

el.convList.addEventListener("click", (e) => {
  const li = e.target.closest("li.conv");
  if (!li) return;
  if (e.target.closest(".conv-open")) switchTo(li.dataset.id);
  else if (e.target.closest(".conv-rename")) startRename(li.dataset.id);
  else if (e.target.closest(".conv-delete")) askDelete(li.dataset.id);
});

// Another tab changed the stored conversations: show them, keeping this tab's
// own open conversation (and leaving a streaming answer alone).
window.addEventListener("storage", (e) => {
  if (e.key !== CONVERSATIONS_KEY || state.current || state.editing || state.renamingId) return;
  const mine = store.activeId;
  store.reload();
  store.activeId = store.get(mine) ? mine : null;
  renderConversation();
  renderList();
});

// -- composing and sending ------------------------------------------------------------------

function readNumber(input, fallback) {
  const v = Number(input.value);
  return input.value.trim() !== "" && Number.isFinite(v) ? v : fallback;
}

function buildMessages(conv) {
  const messages = [];
  const system = el.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conv.messages) {
    if (m.role === "assistant" && m.tool_calls && m.tool_calls.length) {
      // OpenAI's shape: the calls with the turn, content null when it had no prose.
      messages.push({ role: m.role, content: m.content || null,
        tool_calls: m.tool_calls.map((c) => ({ id: c.id, type: "function",
          function: { name: c.function.name, arguments: c.function.arguments } })) });
    } else {
      messages.push({ role: m.role, content: m.content });
    }
  }
  return messages;
}

function setStreaming(on) {
  el.stop.hidden = !on;
  el.send.hidden = on;
  document.body.classList.toggle("streaming", on);
  updateSendEnabled();
}

function canSend() {
  return state.ready && state.current === null;
}

function updateSendEnabled() {
  el.send.disabled = !canSend();
  for (const b of el.messages.querySelectorAll("[data-action=regenerate], .edit-send")) {
    b.disabled = !canSend();
  }
}

/** Asks for an answer to `conv` as it stands (its last message is the user's). */
function startAnswer(conv) {
  const id = `r${state.nextId++}-${Math.random().toString(36).slice(2, 8)}`;
  const message = {
    type: "chat", id, messages: buildMessages(conv),
    temperature: Math.max(0, readNumber(el.temperature, 0.7)),
    top_p: Math.min(1, Math.max(0.01, readNumber(el.topP, 1))),
    max_tokens: Math.max(1, Math.round(readNumber(el.maxTokens, 512))),
  };
  const view = addBubble("assistant", "");
  view.msg.classList.add("streaming");
  view.msg.dataset.requestId = id;
  setMeta(view.meta, [["status", "waiting for the first token…"]]);
  // text: the raw answer; prose: its `content` part when the server splits
  // tool calls out of it (a request with tools), then shown instead of text.
  state.current = { id, conv, text: "", prose: "", split: false, calls: [], view,
    md: new MarkdownView(view.content), tools: new ToolCallsView(view.msg, view.meta),
    renderPending: false };
  state.ws.send(JSON.stringify(message));
  setStreaming(true);
  refreshActions();
}

/** Adds a user message to the active conversation (a new one if none) and asks. */
function sendText(text) {
  if (!text.trim() || !canSend()) return false;
  const conv = store.active || store.create(text);
  conv.messages.push({ role: "user", content: text });
  persisted(store.touch(conv));
  renderList();
  addBubble("user", text, conv.messages.length - 1);
  startAnswer(conv);
  return true;
}

function send() {
  if (!sendText(el.prompt.value)) return;
  el.prompt.value = "";
  autoGrow();
}

function regenerate() {
  const conv = store.active;
  if (!conv || !canSend() || state.editing) return;
  const last = conv.messages[conv.messages.length - 1];
  if (last && last.role === "assistant") {
    conv.messages.pop();
    persisted(store.touch(conv));
  }
  if (!conv.messages.length) return;
  removeBubblesAfter(conv.messages.length - 1);
  startAnswer(conv);
}

function startEdit(msg) {
  const conv = store.active;
  const index = Number(msg.dataset.index);
  if (!conv || state.current || !conv.messages[index]) return;
  state.editing = true;
  refreshActions();
  const view = viewOf(msg);
  const box = document.createElement("textarea");
  box.className = "edit-box";
  box.value = conv.messages[index].content;
  box.setAttribute("aria-label", "Edit your message");
  box.rows = Math.min(10, box.value.split("\n").length + 1);
  const sendButton = document.createElement("button");
  sendButton.type = "button";
  sendButton.className = "primary small edit-send";
  sendButton.textContent = "Send";
  const cancelButton = document.createElement("button");
  cancelButton.type = "button";
  cancelButton.className = "small edit-cancel";
  cancelButton.textContent = "Cancel";
  const row = document.createElement("div");
  row.className = "edit-actions";
  row.append(cancelButton, sendButton);
  const form = document.createElement("div");
  form.className = "edit";
  form.append(box, row);
  view.content.hidden = true;
  msg.insertBefore(form, view.meta);
  msg.classList.add("editing");
  updateSendEnabled();
  box.focus();

  const close = () => {
    form.remove();
    view.content.hidden = false;
    msg.classList.remove("editing");
    state.editing = false;
  };
  const submit = () => {
    const text = box.value;
    if (!text.trim() || !canSend()) return;
    close();
    // The edited message replaces the old one and everything after it.
    conv.messages.splice(index);
    removeBubblesAfter(index - 1);
    sendText(text);
  };
  sendButton.addEventListener("click", submit);
  cancelButton.addEventListener("click", () => { close(); refreshActions(); });
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); close(); refreshActions(); }
  });
}

el.messages.addEventListener("click", (e) => {
  const button = e.target.closest("button");
  if (!button || !el.messages.contains(button)) return;
  const msg = button.closest(".msg");
  if (button.classList.contains("copy-code")) {
    const code = button.closest(".codeblock").querySelector("code");
    flash(button, copyText(code ? code.textContent : ""));
    return;
  }
  switch (button.dataset.action) {
    case "copy-answer": {
      const conv = store.active;
      const m = conv && conv.messages[Number(msg.dataset.index)];
      if (m) flash(button, copyText(m.content));
      break;
    }
    case "edit": startEdit(msg); break;
    case "regenerate": regenerate(); break;
    default: break;
  }
});

/** "Copied" (or "Copy failed") on a copy button for a moment. */
function flash(button, promise) {
  const label = button.textContent;
  promise.then(() => { button.textContent = "Copied"; },
    () => { button.textContent = "Copy failed"; })
    .finally(() => setTimeout(() => { button.textContent = label; }, 1500));
}

function stop() {
  const cur = state.current;
  if (cur && state.ws && state.ws.readyState === WebSocket.OPEN) {
    state.ws.send(JSON.stringify({ type: "cancel", id: cur.id }));
    setMeta(cur.view.meta, [["status", "stopping…"]]);
  }
}

function finishCurrent() {
  const cur = state.current;
  if (!cur) return;
  cur.view.msg.classList.remove("streaming");
  state.current = null;
  setStreaming(false);
  refreshActions();
}

/** Leaving a streaming answer (new chat, another conversation): cancel it and
 *  keep what arrived so far in its conversation, as a stopped answer. */
function abandonCurrent() {
  const cur = state.current;
  if (!cur) return;
  stop();
  if (cur.text || cur.calls.length) {
    cur.conv.messages.push(answerMessage(cur.calls.length ? shownText(cur) : cur.text, cur.calls,
      { finish_reason: "abort", usage: null, ttft_s: null, tokens_per_s: null }));
    persisted(store.touch(cur.conv));
  }
  finishCurrent();
}

function newChat() {
  closePanels();
  abandonCurrent();
  persisted(store.setActive(null));
  renderConversation();
  renderList();
  el.prompt.focus();
}

/** The Markdown shown for a streaming answer: its prose when tool calls are split out. */
function shownText(cur) {
  return cur.split ? cur.prose : cur.text;
}

/** An answer as the conversation keeps it (tool_calls only when it made some). */
function answerMessage(content, calls, meta) {
  const message = { role: "assistant", content, meta };
  if (calls && calls.length) message.tool_calls = calls;
  return message;
}

// Lexing and rendering again is cheap at chat sizes; one render per frame
// keeps fast streams smooth.
function scheduleRender(cur) {
  if (cur.renderPending) return;
  cur.renderPending = true;
  requestAnimationFrame(() => {
    cur.renderPending = false;
    if (state.current !== cur) return;
    const stick = nearBottom();
    cur.md.update(shownText(cur));
    cur.tools.render(cur.calls, false);
    if (stick) scrollToBottom();
  });
}

// -- server messages ------------------------------------------------------------------------

function onDelta(msg) {
  const cur = state.current;
  if (!cur || msg.id !== cur.id) return;
  if (!cur.text && msg.text) setMeta(cur.view.meta, [["status", "streaming…"]]);
  cur.text += msg.text || "";
  if (typeof msg.content === "string") {
    cur.split = true;
    cur.prose += msg.content;
  }
  if (msg.tool_calls) applyFragments(cur.calls, msg.tool_calls);
  scheduleRender(cur);
}

function onDone(msg) {
  const cur = state.current;
  if (!cur || msg.id !== cur.id) return;
  // The done message carries the full text and the complete tool calls: the
  // source of truth for the turn. With calls, the text shown is the prose only.
  cur.text = typeof msg.text === "string" ? msg.text : cur.text;
  cur.calls = cleanCalls(msg.tool_calls) ?? cur.calls;
  const content = cur.calls.length ? shownText(cur) : cur.text;
  cur.md.finish(content);
  cur.tools.render(cur.calls, true);
  const meta = doneMeta(msg);
  showDone(cur.view, meta);
  cur.conv.messages.push(answerMessage(content, cur.calls, meta));
  cur.view.msg.dataset.index = String(cur.conv.messages.length - 1);
  persisted(store.touch(cur.conv));
  renderList();
  finishCurrent();
}

function onError(msg) {
  if (msg.code === 401) {
    state.ready = false;
    updateSendEnabled();
    forgetKey();
    askForKey(state.apiKey ? "That key was not accepted." : "");
    return;
  }
  const cur = state.current;
  if (cur && (msg.id === cur.id || msg.id === undefined)) {
    showError(cur.view, `error ${msg.code}: ${msg.message}`);
    finishCurrent();
    return;
  }
  console.warn("server error", msg);
}

function onHello(msg) {
  el.modelName.textContent = msg.model || "";
  if (msg.auth_required) {
    if (state.apiKey) authenticate(state.apiKey);
    else askForKey("");
  } else {
    onReady();
  }
}

function onReady() {
  state.ready = true;
  state.reconnectDelay = 500;
  setConn("ready", "connected");
  updateSendEnabled();
  state.ws.send(JSON.stringify({ type: "subscribe_stats" }));
}

function handleMessage(event) {
  let msg;
  try { msg = JSON.parse(event.data); } catch { return; }
  switch (msg.type) {
    case "hello": onHello(msg); break;
    case "auth_ok": closeKeyDialog(); onReady(); break;
    case "delta": onDelta(msg); break;
    case "done": onDone(msg); break;
    case "stats": panel.render(msg); break;
    case "error": onError(msg); break;
    default: break;
  }
}

// -- connection, authentication and reconnecting --------------------------------------------

function setConn(kind, text) {
  el.conn.dataset.state = kind;
  el.connText.textContent = text;
}

function wsUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/v1/ws`;
}

function connect() {
  clearTimeout(state.reconnectTimer);
  setConn("connecting", "connecting…");
  const ws = new WebSocket(wsUrl());
  state.ws = ws;
  ws.addEventListener("message", (e) => { if (state.ws === ws) handleMessage(e); });
  ws.addEventListener("close", () => { if (state.ws === ws) onClose(); });
}

function onClose() {
  state.ready = false;
  state.ws = null;
  panel.setLive(false);
  const cur = state.current;
  if (cur) {
    // The server went away mid-answer: keep what arrived on screen, but not in
    // the conversation (Retry asks again).
    cur.view.msg.classList.add("failed");
    setMeta(cur.view.meta, [["status", "connection lost — answer incomplete"]], "err");
    finishCurrent();
  }
  updateSendEnabled();
  const delay = state.reconnectDelay;
  state.reconnectDelay = Math.min(state.reconnectDelay * 2, RECONNECT_MAX_MS);
  setConn("down", `disconnected — retrying in ${Math.round(delay / 100) / 10} s`);
  state.reconnectTimer = setTimeout(connect, delay);
}

function authenticate(key) {
  state.apiKey = key;
  state.ws.send(JSON.stringify({ type: "auth", api_key: key }));
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  localStorage.removeItem(KEY_STORAGE);
}

function askForKey(error) {
  setConn("auth", "API key needed");
  el.authError.textContent = error;
  state.apiKey = "";
  if (!el.authDialog.open) el.authDialog.showModal();
  el.apiKey.select();
}

function closeKeyDialog() {
  if (el.authDialog.open) el.authDialog.close();
  el.authError.textContent = "";
}

el.authForm.addEventListener("submit", (e) => {
  e.preventDefault();
  const key = el.apiKey.value.trim();
  if (!key || !state.ws || state.ws.readyState !== WebSocket.OPEN) return;
  (el.rememberKey.checked ? localStorage : sessionStorage).setItem(KEY_STORAGE, key);
  el.authError.textContent = "";
  authenticate(key);
});
// The dialog is the only way forward while the server wants a key.
el.authDialog.addEventListener("cancel", (e) => e.preventDefault());

// -- settings, keyboard and layout ----------------------------------------------------------

function loadSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
    if (typeof saved.system === "string") el.system.value = saved.system;
    if (saved.temperature !== undefined) el.temperature.value = saved.temperature;
    if (saved.topP !== undefined) el.topP.value = saved.topP;
    if (saved.maxTokens !== undefined) el.maxTokens.value = saved.maxTokens;
  } catch { /* a corrupt entry: keep the defaults */ }
}

function saveSettings() {
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify({
    system: el.system.value, temperature: el.temperature.value, topP: el.topP.value,
    maxTokens: el.maxTokens.value,
  }));
}

function autoGrow() {
  el.prompt.style.height = "auto";
  el.prompt.style.height = `${Math.min(el.prompt.scrollHeight, 200)}px`;
}

// Narrow screens: the conversation list and the settings fold behind buttons.
function togglePanel(name, button) {
  const other = name === "side-open" ? "history-open" : "side-open";
  document.body.classList.remove(other);
  const open = document.body.classList.toggle(name);
  button.setAttribute("aria-expanded", String(open));
  (name === "side-open" ? el.toggleHistory : el.toggleSide).setAttribute("aria-expanded", "false");
}

function closePanels() {
  document.body.classList.remove("history-open");
  el.toggleHistory.setAttribute("aria-expanded", "false");
}

el.composer.addEventListener("submit", (e) => { e.preventDefault(); send(); });
el.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
el.prompt.addEventListener("input", autoGrow);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.current && !el.authDialog.open) stop();
});
el.stop.addEventListener("click", stop);
el.newChat.addEventListener("click", newChat);
el.toggleSide.addEventListener("click", () => togglePanel("side-open", el.toggleSide));
el.toggleHistory.addEventListener("click", () => togglePanel("history-open", el.toggleHistory));
for (const input of [el.system, el.temperature, el.topP, el.maxTokens]) {
  input.addEventListener("change", saveSettings);
}

loadSettings();
renderList();
renderConversation();
setStreaming(false);
connect();
el.prompt.focus();

// For tests and the console: the renderer, the store and the state (read-only use).
window.aioChat = { renderMarkdown, MarkdownView, store, state };
