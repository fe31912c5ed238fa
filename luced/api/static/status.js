// The status view: what `lucectl status` and `lucectl snapshot list` show, from
// GET /v1/status once a second while the page is visible.

import { getJSON } from "./api.js";
import { bytes, duration, el, table } from "./dom.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;

export function startStatus() {
  poll();
}

async function poll() {
  if (document.visibilityState === "visible") {
    try {
      render(await getJSON("/v1/status"));
    } catch (err) {
      $("state").textContent = "unreachable";
      $("state").dataset.state = "error";
      $("status").replaceChildren(el("p", { class: "error" }, err.message));
    }
  }
  setTimeout(poll, POLL_MS);
}

function render(s) {
  $("model-name").textContent = s.model;
  $("state").textContent = s.state;
  $("state").dataset.state = s.state;
  $("uptime").textContent = `up ${duration(s.uptime_s)}`;
  const q = s.queue || {};
  $("status").replaceChildren(
    section("Requests", requests(q)),
    section("Memory", memory(q, s.prefix_cache, s.kv_flash)),
    section("Workers", workers(s.placement)),
    section("Speculation", speculation(s)),
    section("Totals", totals(s.totals)),
    section(`Snapshots (${(s.snapshots || []).length})`, snapshots(s.snapshots || [])),
  );
}

function section(title, ...body) {
  return el("div", { class: "block" }, el("h3", {}, title), ...body);
}

function requests(q) {
  const line = el(
    "p",
    {},
    `${q.running} running (max ${q.max_running}), ${q.waiting} waiting (max ${q.max_queue}), `,
    `${q.queued_tokens} prompt tokens queued`,
    q.mean_batch ? `; mean batch ${q.mean_batch}` : "",
  );
  const rows = [
    ...(q.requests || []).map((r) => ["running", ...request(r)]),
    ...(q.waiting_requests || []).map((r) => ["waiting", ...request(r)]),
  ];
  if (!rows.length) return [line, el("p", { class: "muted", id: "idle" }, "idle")];
  const t = table(["", "id", "prompt", "generated", "age"], rows);
  t.id = "requests";
  return [line, t];
}

function request(r) {
  const id = el("span", { title: r.id }, r.id.length > 20 ? `${r.id.slice(0, 18)}…` : r.id);
  return [id, r.prompt_tokens, r.completion_tokens, duration(r.age_s)];
}

function memory(q, cache, flash) {
  const used = q.kv_usage || 0;
  const out = [
    el(
      "div",
      { class: "meter", title: "KV positions the running requests hold, over the pool" },
      el("meter", { min: 0, max: 1, value: used }),
      ` KV ${(used * 100).toFixed(1)}% of ${q.kv_pool_tokens} positions`,
    ),
  ];
  if (cache) {
    out.push(
      el(
        "div",
        { class: "meter" },
        el("meter", { min: 0, max: 1, value: cache.memory_bytes / (cache.memory_capacity || 1) }),
        ` prefix cache ${bytes(cache.memory_bytes)} of ${bytes(cache.memory_capacity)}, `,
        `${cache.entries} snapshots (${cache.disk_entries} on disk); `,
        `${cache.hits} hits (${cache.hit_tokens} tokens) in ${cache.queries} lookups`,
      ),
    );
    if (cache.disk_problem) out.push(el("p", { class: "error" }, `disk tier off: ${cache.disk_problem}`));
  } else {
    out.push(el("p", { class: "muted" }, "prefix cache off"));
  }
  if (flash) {
    out.push(
      el(
        "p",
        {},
        `KV Flash: pool ${flash.pool_tokens} tokens (${flash.policy}), `,
        `${flash.resident_blocks} blocks resident, ${flash.paged_out_blocks} paged out `,
        `(${bytes(flash.host_bytes)}); ${flash.evictions} evictions, ${flash.recalls} recalls`,
      ),
    );
  }
  return out;
}

function workers(placement) {
  if (!Array.isArray(placement)) return el("p", {}, String(placement ?? "-"));
  const layers = (l) => (Array.isArray(l) ? `[${l[0]}, ${l[1]})` : String(l ?? "-"));
  return table(
    ["group", "devices", "layers", "pid", "state", "restarts", "up"],
    placement.map((w) => [
      w.group,
      (w.devices || []).join(", "),
      layers(w.layers),
      w.pid ?? "-",
      w.state ?? "-",
      w.restarts ?? 0,
      duration(w.uptime_s),
    ]),
  );
}

function speculation(s) {
  const t = s.totals || {};
  if (!t.spec_drafts) return el("p", { class: "muted" }, "no speculative steps yet");
  const blocks = Object.entries(s.block_sizes || {})
    .map(([size, n]) => `${n}×${size}`)
    .join(", ");
  return el(
    "p",
    {},
    `mean acceptance length ${s.mean_acceptance_length} tokens a step; `,
    `${t.spec_drafts} verify steps, ${t.spec_accepted_tokens} drafted tokens accepted`,
    blocks ? `; steps by block size: ${blocks}` : "",
  );
}

function totals(t = {}) {
  return el(
    "p",
    {},
    Object.entries(t)
      .map(([k, v]) => `${v} ${k.replaceAll("_", " ")}`)
      .join(", "),
  );
}

function snapshots(list) {
  if (!list.length) return el("p", { class: "muted" }, "none");
  const now = Date.now() / 1000;
  return table(
    ["id", "tokens", "size", "tier", "hits", "last use", "ends with"],
    list.map((e) => [
      e.id,
      e.tokens,
      bytes(e.bytes),
      e.tier,
      e.hits,
      `${duration(now - e.last_used)} ago`,
      el("span", { class: "snippet", title: e.suffix }, shortTail(e.suffix)),
    ]),
  );
}

function shortTail(text, n = 40) {
  const flat = (text || "").replace(/\s+/g, " ").trim();
  return flat.length > n ? `…${flat.slice(-n)}` : flat;
}
