// The console's own script (docs/console.md): the usage plots (uPlot) and the upload's
// progress bar (htmx's xhr progress event). No inline script: the page's CSP allows none.
"use strict";

function plot(id, data, series, title) {
  const el = document.getElementById(id);
  if (!el || !window.uPlot) return;
  const opts = {
    width: Math.max(320, el.clientWidth || 600),
    height: 220,
    series: [{}].concat(series.map(([label, color]) => ({label: label, stroke: color, width: 2}))),
    axes: [{}, {size: 70}],
    tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"),  // the console speaks UTC
  };
  el.replaceChildren();
  new uPlot(opts, data, el);
}

function usagePlots() {
  const script = document.getElementById("usage-data");
  if (!script) return;
  const d = JSON.parse(script.textContent);
  plot("plot-requests", [d.t, d.requests, d.errors],
       [["requests", "#1f77b4"], ["errors", "#d62728"]]);
  plot("plot-tokens", [d.t, d.prompt_tokens, d.completion_tokens, d.cached_tokens, d.images],
       [["prompt", "#1f77b4"], ["completion", "#ff7f0e"], ["cached", "#2ca02c"], ["images", "#9467bd"]]);
  plot("plot-latency", [d.t, d.p50, d.p95, d.p99],
       [["p50", "#2ca02c"], ["p95", "#ff7f0e"], ["p99", "#d62728"]]);
}

document.addEventListener("DOMContentLoaded", usagePlots);

document.addEventListener("htmx:xhr:progress", (evt) => {
  const bar = document.getElementById("upload-progress");
  if (bar && evt.detail.lengthComputable) {
    bar.value = Math.round((100 * evt.detail.loaded) / evt.detail.total);
  }
});

document.addEventListener("htmx:beforeRequest", () => {
  const flash = document.getElementById("flash");
  if (flash) flash.replaceChildren();
});
