// Model answers as Markdown: parsed by marked, sanitized by DOMPurify, and only
// then put into the page, as DOM nodes (both libraries are vendored in vendor/,
// with their licenses; nothing is fetched from elsewhere).
//
// Three fences, each enough on its own for the common attacks:
//   1. raw HTML in an answer is not rendered at all: marked's html tokens are
//      escaped, so "<script>" or "<img onerror=...>" are shown as those characters;
//   2. DOMPurify sanitizes everything marked produced (a javascript: link written
//      as Markdown, [x](javascript:...), loses its href; no handler attribute, no
//      <style>, <img>, <form>, SVG or MathML survives) and returns a DOM fragment;
//   3. the page's Content-Security-Policy allows no inline script or handler, and
//      with Trusted Types only DOMPurify may turn a string into HTML: an
//      `innerHTML = ...` anywhere else on the page throws.
"use strict";

const { Marked } = globalThis.marked;
const DOMPurify = globalThis.DOMPurify;

const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

const md = new Marked({ gfm: true, breaks: false, async: false });
md.use({
  renderer: {
    // Raw HTML (a block or an inline tag) is shown as text, never rendered.
    html({ text, block }) {
      const shown = escapeHtml(text);
      return block ? `<p>${shown}</p>` : shown;
    },
    // An image would be fetched from wherever the model says (or be blocked by
    // the CSP): show it as a link instead.
    image({ href, title, text }) {
      const label = escapeHtml(text || href);
      const t = title ? ` title="${escapeHtml(title)}"` : "";
      return `<a href="${escapeHtml(href)}"${t}>${label}</a>`;
    },
  },
});

const PURIFY_CONFIG = {
  USE_PROFILES: { html: true },                 // no SVG, no MathML
  FORBID_TAGS: ["style", "img", "form", "input", "button", "textarea", "select", "option",
    "video", "audio", "source", "picture", "iframe", "object", "embed", "dialog"],
  // ids and names could shadow the page's own elements (DOM clobbering).
  FORBID_ATTR: ["style", "id", "name", "target"],
  ALLOW_DATA_ATTR: false,
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#)/i,
  RETURN_DOM_FRAGMENT: true,
};
const LANGUAGE_CLASS = /^language-[\w+#.-]{1,32}$/;

DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
  // marked marks fenced code with class="language-x"; any other class could
  // borrow the page's own styles.
  if (data.attrName === "class" && !LANGUAGE_CLASS.test(data.attrValue)) data.keepAttr = false;
});
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

/** Sanitized DOM for one or more marked tokens, code blocks given a header and a copy button. */
function tokensToFragment(tokens) {
  const frag = DOMPurify.sanitize(md.parser(tokens), PURIFY_CONFIG);
  for (const pre of [...frag.querySelectorAll("pre")]) {
    const code = pre.querySelector("code");
    const lang = code && [...code.classList].find((c) => LANGUAGE_CLASS.test(c));
    const box = document.createElement("div");
    box.className = "codeblock";
    const head = document.createElement("div");
    head.className = "code-head";
    const label = document.createElement("span");
    label.className = "lang";
    label.textContent = lang ? lang.slice("language-".length) : "";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy-code";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy code");
    head.append(label, copy);
    pre.replaceWith(box);
    box.append(head, pre);
  }
  return frag;
}

/** Renders `text` (Markdown) into `container` at once, replacing what it held. */
export function renderMarkdown(container, text) {
  container.replaceChildren(tokensToFragment(md.lexer(text)));
}

/**
 * A container that follows a growing Markdown text (a streamed answer).
 *
 * Each `update(text)` lexes the whole text again (cheap at chat sizes) but
 * re-renders only from the first top-level block whose source changed, so the
 * blocks above stay the same nodes: a finished code block keeps its copy
 * button and a selection in it survives the stream. `finish(text)` renders the
 * final text once more from scratch (a reference link defined late in the
 * answer changes blocks above it).
 */
export class MarkdownView {
  constructor(container) {
    this.container = container;
    this.blocks = [];              // [{raw, nodes}] per top-level token, in order
  }

  update(text) {
    const tokens = md.lexer(text);
    let same = 0;
    while (same < this.blocks.length && same < tokens.length
           && this.blocks[same].raw === tokens[same].raw) same++;
    for (const block of this.blocks.splice(same)) {
      for (const node of block.nodes) node.remove();
    }
    for (const token of tokens.slice(same)) {
      const frag = tokensToFragment([token]);
      const nodes = [...frag.childNodes];
      this.container.appendChild(frag);
      this.blocks.push({ raw: token.raw, nodes });
    }
  }

  finish(text) {
    this.blocks = [];
    this.container.replaceChildren();
    this.update(text);
  }
}

/** Copies `text` to the clipboard; falls back to a hidden textarea where the
 *  Clipboard API is missing (plain http on another host is not a secure context). */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "visually-hidden";
  document.body.appendChild(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("copy refused");
}
