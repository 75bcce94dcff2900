// Tool calls of an answer (a chat request with `tools`; docs/websocket.md), each
// shown as its own element below the answer's Markdown: the function name as a
// header, the call's id as a small label and the arguments, growing as their
// fragments stream in, pretty-printed JSON once the answer is done.
//
// Names, ids and arguments are model output: they reach the page only as
// textContent, never parsed as HTML (and Trusted Types would refuse it anyway).
"use strict";

/** `args` (JSON text) pretty-printed, or as it came when it is not valid JSON. */
export function prettyArguments(args) {
  try {
    return JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    return args;
  }
}

const emptyCall = () => ({ id: null, type: "function", function: { name: "", arguments: "" } });

/** Adds one delta's `tool_calls` fragments to `calls` (the calls so far, OpenAI's
 *  shape): the first fragment of a call brings its `id`, `type` and
 *  `function.name`, later ones pieces of `function.arguments` to append. */
export function applyFragments(calls, fragments) {
  if (!Array.isArray(fragments)) return calls;
  for (const f of fragments) {
    if (!f || typeof f !== "object") continue;
    const index = Number.isInteger(f.index) && f.index >= 0 ? f.index
      : Math.max(0, calls.length - 1);
    while (calls.length <= index) calls.push(emptyCall());
    const call = calls[index];
    if (typeof f.id === "string" && f.id) call.id = f.id;
    if (typeof f.type === "string" && f.type) call.type = f.type;
    const fn = f.function && typeof f.function === "object" ? f.function : {};
    if (typeof fn.name === "string" && fn.name) call.function.name = fn.name;
    if (typeof fn.arguments === "string") call.function.arguments += fn.arguments;
  }
  return calls;
}

/** The complete calls of a `done` message (or a stored answer), in OpenAI's shape,
 *  anything else dropped; null when `list` is not a list. */
export function cleanCalls(list) {
  if (!Array.isArray(list)) return null;
  return list.filter((c) => c && typeof c === "object" && c.function
      && typeof c.function === "object")
    .map((c) => ({
      id: typeof c.id === "string" ? c.id : null,
      type: "function",
      function: {
        name: String(c.function.name ?? ""),
        arguments: typeof c.function.arguments === "string" ? c.function.arguments
          : JSON.stringify(c.function.arguments ?? ""),
      },
    }));
}

function callElement() {
  const root = document.createElement("section");
  root.className = "tool-call";
  const head = document.createElement("header");
  head.className = "tool-head";
  const kind = document.createElement("span");
  kind.className = "tool-kind";
  kind.textContent = "tool call";
  const name = document.createElement("h3");
  name.className = "tool-name";
  const id = document.createElement("code");
  id.className = "tool-id";
  id.title = "tool call id";
  head.append(kind, name, id);
  const pre = document.createElement("pre");
  pre.className = "tool-args";
  const args = document.createElement("code");
  pre.append(args);
  root.append(head, pre);
  return { root, name, id, args };
}

/** The tool-call elements of one answer bubble, kept in step with a list of calls. */
export class ToolCallsView {
  /** `msg`: the answer's bubble; the list goes just before `before` (its meta line). */
  constructor(msg, before) {
    this.msg = msg;
    this.before = before;
    this.box = null;
    this.items = [];
  }

  /** Shows `calls`; `final`: the answer is done, so arguments are pretty-printed. */
  render(calls, final) {
    if (!calls || !calls.length) {
      if (this.box) this.box.remove();
      this.box = null;
      this.items = [];
      this.msg.classList.remove("has-tool-calls");
      return;
    }
    if (!this.box) {
      this.box = document.createElement("div");
      this.box.className = "tool-calls";
      this.msg.insertBefore(this.box, this.before);
      this.msg.classList.add("has-tool-calls");
    }
    calls.forEach((call, i) => {
      let item = this.items[i];
      if (!item) {
        item = callElement();
        item.root.dataset.index = String(i);
        this.items.push(item);
        this.box.append(item.root);
      }
      const name = call.function.name || "(unnamed)";
      if (item.name.textContent !== name) item.name.textContent = name;
      const id = call.id || "";
      if (item.id.textContent !== id) item.id.textContent = id;
      item.id.hidden = !id;
      const args = final ? prettyArguments(call.function.arguments) : call.function.arguments;
      if (item.args.textContent !== args) item.args.textContent = args;
      item.root.dataset.state = final ? "done" : "streaming";
    });
    for (const extra of this.items.splice(calls.length)) extra.root.remove();
  }
}
