// aioengine chat page: multi-turn chat over the WebSocket API at /v1/ws
// (protocol: docs/websocket.md) and a live engine panel fed by its stats
// subscription. Plain JavaScript, no build step, nothing fetched from elsewhere.
//
// Safety: model output and user text only ever reach the page as DOM text
// (createTextNode / textContent). No innerHTML anywhere in this file.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = {
    messages: $("messages"), empty: $("empty"), composer: $("composer"), prompt: $("prompt"),
    send: $("send"), stop: $("stop"), newChat: $("new-chat"), toggleSide: $("toggle-side"),
    side: $("side"), system: $("system-prompt"), temperature: $("temperature"),
    maxTokens: $("max-tokens"), conn: $("conn"), connText: $("conn-text"),
    modelName: $("model-name"), engine: $("engine"), grid: $("block-grid"),
    gridScale: $("grid-scale"), authDialog: $("auth-dialog"), authForm: $("auth-form"),
    apiKey: $("api-key"), rememberKey: $("remember-key"), authError: $("auth-error"),
    stat: {
      running: $("stat-running"), waiting: $("stat-waiting"), used: $("stat-blocks-used"),
      total: $("stat-blocks-total"), hitRate: $("stat-hit-rate"),
      preemptions: $("stat-preemptions"), lastStep: $("stat-last-step"),
    },
  };

  const KEY_STORAGE = "aioengine.apiKey";
  const SETTINGS_STORAGE = "aioengine.settings";
  const MAX_GRID_CELLS = 768;       // more blocks than this: one square stands for several
  const RECONNECT_MAX_MS = 5000;

  // -- state ------------------------------------------------------------------------------
  const state = {
    ws: null,
    ready: false,             // connected and authenticated
    apiKey: sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || "",
    reconnectDelay: 500,
    reconnectTimer: null,
    history: [],              // [{role, content}] of finished turns
    current: null,            // the answer being streamed: {id, userTurn, text, view, ...}
    nextId: 1,
  };

  // -- rendering: text only, with a small safe Markdown subset built from DOM nodes ----------

  // Inline spans: `code` and **bold**. Splitting with a capture group puts the
  // captured spans at odd indices; every piece becomes a text node.
  function appendInline(parent, text) {
    const codeParts = text.split(/`([^`\n]+)`/);
    codeParts.forEach((part, i) => {
      if (i % 2 === 1) {
        const code = document.createElement("code");
        code.textContent = part;
        parent.appendChild(code);
        return;
      }
      part.split(/\*\*([^*\n]+)\*\*/).forEach((piece, j) => {
        if (!piece) return;
        if (j % 2 === 1) {
          const strong = document.createElement("strong");
          strong.textContent = piece;
          parent.appendChild(strong);
        } else {
          parent.appendChild(document.createTextNode(piece));
        }
      });
    });
  }

  // Renders `text` into `container`: ``` fences become <pre><code>, the rest is
  // text with inline spans (white-space: pre-wrap keeps line breaks). An open
  // fence while streaming is shown as code up to the end.
  function renderAnswer(container, text) {
    const frag = document.createDocumentFragment();
    const lines = text.split("\n");
    let prose = [];
    let code = null;           // {lang, lines} while inside a fence
    const flushProse = () => {
      if (prose.length) {
        const div = document.createElement("div");
        div.className = "prose";
        appendInline(div, prose.join("\n"));
        frag.appendChild(div);
      }
      prose = [];
    };
    const flushCode = () => {
      const pre = document.createElement("pre");
      if (code.lang) pre.dataset.lang = code.lang;
      const c = document.createElement("code");
      c.textContent = code.lines.join("\n");
      pre.appendChild(c);
      frag.appendChild(pre);
      code = null;
    };
    for (const line of lines) {
      const fence = /^\s*```(.*)$/.exec(line);
      if (fence && code === null) {
        flushProse();
        code = { lang: fence[1].trim().slice(0, 20), lines: [] };
      } else if (fence && code !== null) {
        flushCode();
      } else if (code !== null) {
        code.lines.push(line);
      } else {
        prose.push(line);
      }
    }
    if (code !== null) flushCode();
    flushProse();
    container.replaceChildren(frag);
  }

  // -- the conversation view ------------------------------------------------------------------

  function nearBottom() {
    const m = el.messages;
    return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
  }

  function scrollToBottom() {
    el.messages.scrollTop = el.messages.scrollHeight;
  }

  function addBubble(role, text) {
    el.empty.hidden = true;
    const stick = nearBottom();
    const msg = document.createElement("article");
    msg.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "Model";
    const content = document.createElement("div");
    content.className = "content";
    const meta = document.createElement("div");
    meta.className = "meta";
    msg.append(who, content, meta);
    if (role === "user") content.textContent = text; else renderAnswer(content, text);
    el.messages.appendChild(msg);
    if (stick || role === "user") scrollToBottom();
    return { msg, content, meta };
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

  const FINISH_LABEL = { stop: "", length: "max tokens reached", abort: "stopped" };

  function showDone(view, done) {
    const usage = done.usage || {};
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    const parts = [
      ["ttft", `TTFT ${fmt(done.ttft_s === null ? null : done.ttft_s * 1000, 0)} ms`,
       "time to first token"],
      ["tps", `${fmt(done.tokens_per_s, 1)} tok/s`, "decode speed after the first token"],
      ["completion", `${usage.completion_tokens ?? 0} tokens`, "tokens in this answer"],
      ["prompt", `prompt ${usage.prompt_tokens ?? 0} (${cached} cached)`,
       "prompt tokens, and how many came from the prefix cache"],
    ];
    const label = FINISH_LABEL[done.finish_reason] ?? String(done.finish_reason || "");
    if (label) parts.push(["status", label]);
    setMeta(view.meta, parts, done.finish_reason === "abort" ? "warn" : "");
  }

  function showError(view, message) {
    view.msg.classList.add("failed");
    setMeta(view.meta, [["status", message]], "err");
  }

  // -- composing and sending --------------------------------------------------------------------

  function readNumber(input, fallback) {
    const v = Number(input.value);
    return input.value.trim() !== "" && Number.isFinite(v) ? v : fallback;
  }

  function buildMessages(userText) {
    const messages = [];
    const system = el.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history, { role: "user", content: userText });
    return messages;
  }

  function setStreaming(on) {
    el.stop.hidden = !on;
    el.send.hidden = on;
    document.body.classList.toggle("streaming", on);
    updateSendEnabled();
  }

  function updateSendEnabled() {
    el.send.disabled = !state.ready || state.current !== null;
  }

  function send() {
    const text = el.prompt.value;
    if (!text.trim() || !state.ready || state.current !== null) return;
    const id = `r${state.nextId++}-${Math.random().toString(36).slice(2, 8)}`;
    const message = {
      type: "chat", id, messages: buildMessages(text),
      temperature: Math.max(0, readNumber(el.temperature, 0.7)),
      max_tokens: Math.max(1, Math.round(readNumber(el.maxTokens, 512))),
    };
    addBubble("user", text);
    const view = addBubble("assistant", "");
    view.msg.classList.add("streaming");
    view.msg.dataset.requestId = id;
    setMeta(view.meta, [["status", "waiting for the first token…"]]);
    state.current = { id, userText: text, text: "", view, renderPending: false };
    state.ws.send(JSON.stringify(message));
    el.prompt.value = "";
    autoGrow();
    setStreaming(true);
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
  }

  function newChat() {
    stop();
    finishCurrent();
    state.history = [];
    for (const node of [...el.messages.querySelectorAll(".msg")]) node.remove();
    el.empty.hidden = false;
    el.prompt.focus();
  }

  // Rendering the whole answer again is cheap at chat sizes; batching it to one
  // render per frame keeps fast streams smooth.
  function scheduleRender(cur) {
    if (cur.renderPending) return;
    cur.renderPending = true;
    requestAnimationFrame(() => {
      cur.renderPending = false;
      const stick = nearBottom();
      renderAnswer(cur.view.content, cur.text);
      if (stick) scrollToBottom();
    });
  }

  // -- server messages ---------------------------------------------------------------------------

  function onDelta(msg) {
    const cur = state.current;
    if (!cur || msg.id !== cur.id) return;
    if (!cur.text && msg.text) setMeta(cur.view.meta, [["status", "streaming…"]]);
    cur.text += msg.text || "";
    scheduleRender(cur);
  }

  function onDone(msg) {
    const cur = state.current;
    if (!cur || msg.id !== cur.id) return;
    // The done message carries the full text: the source of truth for the turn.
    cur.text = typeof msg.text === "string" ? msg.text : cur.text;
    renderAnswer(cur.view.content, cur.text);
    showDone(cur.view, msg);
    cur.view.msg.dataset.finish = msg.finish_reason || "";
    state.history.push({ role: "user", content: cur.userText },
                       { role: "assistant", content: cur.text });
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
      case "stats": renderStats(msg); break;
      case "error": onError(msg); break;
      default: break;
    }
  }

  // -- connection, authentication and reconnecting ----------------------------------------------

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
    el.engine.dataset.live = "false";
    const cur = state.current;
    if (cur) {
      // The server went away mid-answer: keep what arrived, but not as history.
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

  // -- the engine panel ---------------------------------------------------------------------------

  let gridCells = [];
  let gridScale = 1;

  function buildGrid(numBlocks) {
    gridScale = Math.max(1, Math.ceil(numBlocks / MAX_GRID_CELLS));
    const numCells = Math.ceil(numBlocks / gridScale);
    const frag = document.createDocumentFragment();
    gridCells = [];
    for (let i = 0; i < numCells; i++) {
      const cell = document.createElement("i");
      cell.className = "b0";
      frag.appendChild(cell);
      gridCells.push(cell);
    }
    el.grid.replaceChildren(frag);
    el.grid.dataset.blocks = String(numBlocks);
    el.gridScale.textContent = gridScale > 1 ? `1 square = ${gridScale} blocks` : "";
  }

  function renderGrid(map) {
    if (gridCells.length === 0 || Number(el.grid.dataset.blocks) !== map.length) {
      buildGrid(map.length);
    }
    for (let c = 0; c < gridCells.length; c++) {
      // A square standing for several blocks shows the busiest of them.
      let v = 0;
      const end = Math.min(map.length, (c + 1) * gridScale);
      for (let b = c * gridScale; b < end && v < 2; b++) v = Math.max(v, map[b]);
      const cls = `b${v}`;
      if (gridCells[c].className !== cls) gridCells[c].className = cls;
    }
  }

  function renderStats(s) {
    el.engine.dataset.live = "true";
    el.stat.running.textContent = s.num_running;
    el.stat.waiting.textContent = s.num_waiting;
    el.stat.used.textContent = s.num_kv_blocks_used;
    el.stat.total.textContent = s.num_kv_blocks_total;
    el.stat.hitRate.textContent = s.prefix_cache_queries > 0
      ? `${(100 * s.prefix_cache_hits / s.prefix_cache_queries).toFixed(1)} %`
      : "–";
    el.stat.hitRate.title = `${s.prefix_cache_hits} of ${s.prefix_cache_queries} prompt tokens`;
    el.stat.preemptions.textContent = s.num_preemptions;
    el.stat.lastStep.textContent =
      `${s.num_reqs_last_step} req · ${s.num_tokens_last_step} tok`;
    if (Array.isArray(s.block_usage_map) && s.block_usage_map.length) {
      renderGrid(s.block_usage_map);
    }
  }

  // -- settings, keyboard and layout ----------------------------------------------------------------

  function loadSettings() {
    try {
      const saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
      if (typeof saved.system === "string") el.system.value = saved.system;
      if (saved.temperature !== undefined) el.temperature.value = saved.temperature;
      if (saved.maxTokens !== undefined) el.maxTokens.value = saved.maxTokens;
    } catch { /* a corrupt entry: keep the defaults */ }
  }

  function saveSettings() {
    localStorage.setItem(SETTINGS_STORAGE, JSON.stringify({
      system: el.system.value, temperature: el.temperature.value,
      maxTokens: el.maxTokens.value,
    }));
  }

  function autoGrow() {
    el.prompt.style.height = "auto";
    el.prompt.style.height = `${Math.min(el.prompt.scrollHeight, 200)}px`;
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
  el.toggleSide.addEventListener("click", () => {
    const open = document.body.classList.toggle("side-open");
    el.toggleSide.setAttribute("aria-expanded", String(open));
  });
  for (const input of [el.system, el.temperature, el.maxTokens]) {
    input.addEventListener("change", saveSettings);
  }

  loadSettings();
  setStreaming(false);
  connect();
  el.prompt.focus();

  // For tests and the console: the renderer, and the state (read-only use).
  window.aioChat = { renderAnswer, state };
})();
