// Conversations kept in the browser's localStorage, under one key as JSON:
//   {version: 1, activeId, conversations: [{id, title, created, updated, messages}]}
// with messages [{role: "user" | "assistant", content, meta?, tool_calls?}] (meta:
// the answer's `done` figures; tool_calls: the calls the answer made, OpenAI's
// [{id, type: "function", function: {name, arguments}}], arguments as JSON text). Only finished turns are stored; a conversation is
// stored from its first message on, so "New chat" leaves nothing empty behind.
"use strict";

export const CONVERSATIONS_KEY = "aioengine.conversations";
const TITLE_MAX = 48;

const newId = () => (crypto.randomUUID ? crypto.randomUUID()
  : `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 10)}`);

function isToolCall(c) {
  return c && typeof c === "object" && c.function && typeof c.function.name === "string"
    && typeof c.function.arguments === "string"
    && (c.id === undefined || c.id === null || typeof c.id === "string");
}

function isMessage(m) {
  return m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string"
    && (m.tool_calls === undefined
        || (Array.isArray(m.tool_calls) && m.tool_calls.every(isToolCall)));
}

function isConversation(c) {
  return c && typeof c.id === "string" && typeof c.title === "string"
    && Array.isArray(c.messages) && c.messages.every(isMessage);
}

/** A title from the first user message: its first line, shortened. */
export function titleFor(text) {
  const line = text.trim().split("\n")[0].trim() || "Untitled";
  return line.length > TITLE_MAX ? `${line.slice(0, TITLE_MAX - 1)}…` : line;
}

export class ConversationStore {
  constructor(storage = localStorage, key = CONVERSATIONS_KEY) {
    this.storage = storage;
    this.key = key;
    this.conversations = [];
    this.activeId = null;
    this.reload();
  }

  /** Reads the stored state again (another tab may have changed it); a corrupt
   *  entry counts as no conversations rather than breaking the page. */
  reload() {
    let saved = null;
    try { saved = JSON.parse(this.storage.getItem(this.key) || "null"); } catch { saved = null; }
    const list = saved && Array.isArray(saved.conversations) ? saved.conversations : [];
    this.conversations = list.filter(isConversation);
    this.activeId = saved && this.get(saved.activeId) ? saved.activeId : null;
  }

  /** Writes everything; false when the browser refused (storage full or off). */
  save() {
    try {
      this.storage.setItem(this.key, JSON.stringify({
        version: 1, activeId: this.activeId, conversations: this.conversations,
      }));
      return true;
    } catch (err) {
      console.warn("could not save the conversations", err);
      return false;
    }
  }

  /** Conversations, most recently changed first. */
  list() {
    return [...this.conversations].sort((a, b) => (b.updated || 0) - (a.updated || 0));
  }

  get(id) {
    return this.conversations.find((c) => c.id === id) || null;
  }

  get active() {
    return this.get(this.activeId);
  }

  /** A new conversation holding `firstUserText`, made the active one. */
  create(firstUserText) {
    const now = Date.now();
    const conv = { id: newId(), title: titleFor(firstUserText), created: now, updated: now,
      messages: [] };
    this.conversations.push(conv);
    this.activeId = conv.id;
    return conv;
  }

  touch(conv) {
    conv.updated = Date.now();
    return this.save();
  }

  setActive(id) {
    this.activeId = this.get(id) ? id : null;
    return this.save();
  }

  rename(id, title) {
    const conv = this.get(id);
    const clean = title.trim().slice(0, 200);
    if (!conv || !clean) return false;
    conv.title = clean;
    return this.save();
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.activeId === id) this.activeId = null;
    return this.save();
  }
}
