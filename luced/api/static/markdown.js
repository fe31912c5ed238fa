// Markdown from the model, as safe HTML. marked renders it; raw HTML in the text is shown
// as text (escaped), not parsed; DOMPurify then removes anything that could run (a
// javascript: link, an event attribute) whatever marked let through. The page's
// Content-Security-Policy is the third wall: no inline script or style would run anyway.

import { Marked } from "./vendor/marked-18.2.1/marked.esm.js";
import DOMPurify from "./vendor/dompurify-3.4.18/purify.es.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

function escape(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const marked = new Marked({
  gfm: true,
  renderer: {
    html({ text }) {
      return escape(text);
    },
  },
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

// The rendered text as a DocumentFragment, to put in place with replaceChildren.
export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text), {
    USE_PROFILES: { html: true },
    FORBID_ATTR: ["style"],
    RETURN_DOM_FRAGMENT: true,
  });
}
