// The chat: a conversation kept in local storage (it survives a reload), streamed from
// /v1/chat/completions. Stop aborts the stream; the daemon, seeing its client go, stops
// the request within one step.

import { call, events, getJSON } from "./api.js";
import { el } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

const STORE = "luced.chat";
const NUMBERS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];
const DEFAULTS = {
  model: "",
  system: "",
  temperature: "0.7",
  top_p: "0.95",
  top_k: "",
  min_p: "",
  max_tokens: "1024",
  seed: "",
};

const $ = (id) => document.getElementById(id);

let conversation = load();
let running = null; // the AbortController of the stream in flight

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE));
    if (saved && Array.isArray(saved.messages)) {
      return { messages: saved.messages, settings: { ...DEFAULTS, ...saved.settings } };
    }
  } catch {
    // unreadable: start afresh
  }
  return { messages: [], settings: { ...DEFAULTS } };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversation));
}

export function startChat() {
  const { settings } = conversation;
  for (const name of ["system", ...NUMBERS]) {
    const input = $(name);
    input.value = settings[name];
    input.addEventListener("input", () => {
      settings[name] = input.value;
      save();
    });
  }
  if (settings.system) $("settings").open = true;
  $("model").addEventListener("change", () => {
    settings.model = $("model").value;
    save();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (running) running.abort();
    else send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!running) send();
    }
  });
  $("new-chat").addEventListener("click", () => {
    if (running) running.abort();
    conversation.messages = [];
    save();
    $("messages").replaceChildren();
  });
  for (const message of conversation.messages) show(message);
  scrollDown(true);
  loadModels();
}

async function loadModels() {
  let data;
  try {
    ({ data } = await getJSON("/v1/models"));
  } catch {
    setTimeout(loadModels, 2000); // the status view says why; try again
    return;
  }
  const select = $("model");
  select.replaceChildren(...data.map((m) => el("option", { value: m.id }, m.id)));
  const known = data.some((m) => m.id === conversation.settings.model);
  select.value = known ? conversation.settings.model : data[0]?.id || "";
}

function requestBody(messages) {
  const { settings } = conversation;
  const body = {
    model: settings.model || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (settings.system.trim()) messages.unshift({ role: "system", content: settings.system });
  for (const name of NUMBERS) {
    if (settings[name] !== "" && settings[name] !== null) body[name] = Number(settings[name]);
  }
  return body;
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim()) return;
  $("prompt").value = "";
  // Earlier turns as the model saw them; failed answers are left out.
  const history = conversation.messages
    .filter((m) => !m.error)
    .map(({ role, content }) => ({ role, content }));
  const user = { role: "user", content: text };
  const reply = { role: "assistant", content: "" };
  conversation.messages.push(user, reply);
  save();
  show(user);
  const view = show(reply, "streaming");
  scrollDown(true);

  running = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null;
  let savedAt = started;
  try {
    const resp = await call("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody([...history, { role: "user", content: text }])),
      signal: running.signal,
    });
    for await (const chunk of events(resp)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        first ??= performance.now();
        reply.content += delta;
        view.update();
        if (performance.now() - savedAt > 1000) {
          save(); // a reload mid-stream keeps what came so far
          savedAt = performance.now();
        }
      }
      if (chunk.usage) reply.usage = chunk.usage;
    }
  } catch (err) {
    if (err.name === "AbortError") reply.stopped = true;
    else reply.error = err.message;
  } finally {
    running = null;
    setBusy(false);
    reply.stats = stats(reply, started, first, performance.now());
    save();
    view.update(reply.stopped ? "stopped" : reply.error ? "error" : "done");
  }
}

function stats(reply, started, first, ended) {
  const parts = [];
  const n = reply.usage?.completion_tokens;
  if (n !== undefined) parts.push(`${n} tokens`);
  if (first !== null) {
    parts.push(`first token ${((first - started) / 1000).toFixed(2)} s`);
    if (n > 1 && ended > first) parts.push(`${((n - 1) / ((ended - first) / 1000)).toFixed(1)} tokens/s`);
  }
  const cached = reply.usage?.prompt_tokens_details?.cached_tokens;
  if (cached) parts.push(`${cached} prompt tokens cached`);
  return parts.join(" · ");
}

function setBusy(busy) {
  const button = $("send");
  button.textContent = busy ? "Stop" : "Send";
  button.classList.toggle("stop", busy);
}

// One message in the list; returns a view whose update() re-renders it (at most once a
// frame while tokens stream in).
function show(message, state = null) {
  const body = el("div", { class: "body" });
  const meta = el("div", { class: "meta" });
  const item = el(
    "li",
    { class: `message ${message.role}` },
    el("div", { class: "role" }, message.role),
    body,
    meta,
  );
  let queued = false;

  function render() {
    queued = false;
    if (message.role === "assistant") {
      body.replaceChildren(renderMarkdown(message.content));
      addCopyButtons(body);
    } else {
      body.textContent = message.content;
    }
    const notes = [message.stats, message.stopped && "stopped", message.error].filter(Boolean);
    meta.textContent = notes.join(" · ");
    item.classList.toggle("failed", Boolean(message.error));
    scrollDown();
  }

  const finished = message.stopped ? "stopped" : message.error ? "error" : "done";
  item.dataset.state = state || finished;
  render();
  $("messages").append(item);
  return {
    update(newState) {
      if (newState) {
        item.dataset.state = newState;
        render();
      } else if (!queued) {
        queued = true;
        requestAnimationFrame(render);
      }
    },
  };
}

function addCopyButtons(body) {
  if (!navigator.clipboard) return; // only in a secure context (loopback is one)
  for (const pre of body.querySelectorAll("pre")) {
    const button = el("button", { type: "button", class: "copy plain" }, "copy");
    button.addEventListener("click", () => {
      navigator.clipboard.writeText(pre.querySelector("code")?.textContent ?? pre.textContent);
      button.textContent = "copied";
    });
    pre.prepend(button);
  }
}

function scrollDown(force = false) {
  const list = $("messages");
  const near = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
  if (force || near) list.scrollTop = list.scrollHeight;
}
