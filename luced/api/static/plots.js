// Plots of the last ten minutes, from the daemon's own per-second samples
// (GET /v1/status/history): each poll asks only for the seconds after the last one it has.

import uPlot from "./vendor/uplot-1.6.32/uPlot.esm.js";
import { getJSON } from "./api.js";
import { el } from "./dom.js";

const POLL_MS = 2000;
const HEIGHT = 150;
const COLORS = ["#2563eb", "#f59e0b", "#10b981"];

// Each plot: id, title, unit, then its series as [label, column of the history, scale
// from the column to the unit shown].
const PLOTS = [
  plot("throughput", "Throughput", "tokens/s", ["generated", "generation_tokens", 1], ["prompt", "prompt_tokens", 1]),
  plot("latency", "Latency", "ms", ["time to first token", "ttft_s", 1000], ["between tokens", "itl_s", 1000]),
  plot("load", "Requests and batch", "", ["running", "running", 1], ["waiting", "waiting", 1], ["batch size", "batch_size", 1]),
  plot("kv", "KV use", "%", ["KV", "kv_usage", 100]),
  plot("acceptance", "Speculation acceptance", "%", ["drafted tokens accepted", "acceptance", 100]),
];

function plot(id, title, unit, ...series) {
  return { id, title, unit, series };
}

let history = null; // {column: [values]}, oldest first
const charts = [];

export function startPlots() {
  const root = document.getElementById("plots");
  for (const plot of PLOTS) {
    const caption = el("span", { class: "muted caption" });
    const box = el("div", { class: "chart" });
    root.append(
      el("div", { class: "plot", id: `plot-${plot.id}` }, el("h3", {}, plot.title, " ", caption), box),
    );
    const chart = new uPlot(options(plot, root.clientWidth), [[], ...plot.series.map(() => [])], box);
    charts.push({ plot, chart, caption, card: box.parentElement });
  }
  new ResizeObserver(() => {
    for (const { chart } of charts) chart.setSize({ width: root.clientWidth, height: HEIGHT });
  }).observe(root);
  poll();
}

function options(plot, width) {
  const axis = { stroke: "#6b7280", grid: { stroke: "#e5e7eb", width: 1 }, ticks: { show: false } };
  return {
    width,
    height: HEIGHT,
    cursor: { drag: { x: false, y: false } },
    legend: { live: false }, // the names only: the caption says the peak
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
    axes: [{ ...axis, values: clock }, { ...axis, size: 48 }],
    series: [
      {},
      ...plot.series.map(([label], i) => ({
        label,
        stroke: COLORS[i],
        width: 1.5,
        value: (u, v) => (v === null || v === undefined ? "–" : `${round(v)} ${plot.unit}`),
      })),
    ],
  };
}

async function poll() {
  if (document.visibilityState === "visible") {
    try {
      const last = history?.t.at(-1);
      const fresh = await getJSON(`/v1/status/history${last ? `?since=${last}` : ""}`);
      append(fresh);
      draw();
    } catch {
      // the status view shows why the daemon cannot be reached
    }
  }
  setTimeout(poll, POLL_MS);
}

function append(fresh) {
  if (!history) {
    const columns = Object.keys(fresh).filter((k) => Array.isArray(fresh[k]));
    history = Object.fromEntries(columns.map((k) => [k, []]));
  }
  for (const [column, values] of Object.entries(history)) {
    values.push(...(fresh[column] || []));
  }
  const oldest = history.t.findIndex((t) => t > history.t.at(-1) - fresh.span_s);
  if (oldest > 0) for (const values of Object.values(history)) values.splice(0, oldest);
}

function draw() {
  for (const { plot, chart, caption, card } of charts) {
    const columns = plot.series.map(([, column, scale]) =>
      history[column].map((v) => (v === null ? null : v * scale)),
    );
    chart.setData([history.t, ...columns]);
    const first = columns[0].filter((v) => v !== null);
    const peak = first.length ? Math.max(...first) : null;
    caption.textContent = peak === null ? "" : `peak ${round(peak)} ${plot.unit}`;
    card.dataset.samples = history.t.length;
    card.dataset.peak = peak ?? "";
  }
}

// Time of day on the x axis: with seconds while the ticks are closer than a minute.
function clock(u, ticks, axis, space, step) {
  const format = { hour: "2-digit", minute: "2-digit", hour12: false };
  if (step < 60) format.second = "2-digit";
  return ticks.map((t) => new Date(t * 1000).toLocaleTimeString([], format));
}

function round(v) {
  return Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1);
}
