// Calls to the daemon. The API key, when the daemon wants one, is asked for once and kept
// in this tab's session storage (gone when the tab closes); every call sends it.

const KEY_ITEM = "luced.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let asking = null; // the pending question for the key, shared by every caller

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

// Show the key dialog; resolves once it closes. `wrong`: the last key was refused.
export function askForKey(wrong = false) {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  document.getElementById("key-error").textContent = wrong && apiKey() ? "That key was refused." : "";
  asking = new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY_ITEM, input.value.trim());
      input.value = "";
      dialog.close();
    };
    // Closed by the button or by Escape: the callers try again (and ask again on a 401).
    dialog.addEventListener(
      "close",
      () => {
        asking = null;
        resolve();
      },
      { once: true },
    );
  });
  dialog.showModal();
  input.focus();
  return asking;
}

// fetch() with the key; a 401 asks for the key and tries again. Other errors throw
// ApiError with the daemon's message (its errors are {"error": {"message"}}).
export async function call(path, init = {}) {
  for (;;) {
    const headers = new Headers(init.headers || {});
    const key = apiKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const resp = await fetch(path, { ...init, headers });
    if (resp.status === 401) {
      await askForKey(true);
      continue;
    }
    if (!resp.ok) throw new ApiError(resp.status, await errorMessage(resp));
    return resp;
  }
}

export async function getJSON(path) {
  return (await call(path)).json();
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${resp.status} ${resp.statusText}`;
  }
}

// The JSON events of a server-sent event stream, until [DONE] or its end.
export async function* events(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}
