/* Charts on the vendored uPlot (the global `uPlot`, loaded by a classic script before the modules):
   the x axis a page chooses (step, tokens seen, wall time), log scale, a hover tooltip with every
   series' value, and a chart's data as CSV or its picture (title, axes' names, legend) as PNG or SVG. */

import { el } from "./dom.js";
import { fmt, fmtDuration, fmtEng, fmtInt, fmtTicks } from "./format.js";

export const PALETTE = ["#1f6fb2", "#d9480f", "#2b8a3e", "#9c36b5", "#c92a2a", "#0b7285", "#e67700",
  "#5c940d", "#862e9c", "#495057"];

/* TensorBoard's debiased EMA: last = w·last + (1−w)·y; debias = w·debias + (1−w); s = last/debias.
   Missing values stay missing and do not move the average. */
export function smooth(ys, w) {
  let last = 0, debias = 0;
  return ys.map((y) => {
    if (y === null || y === undefined || !isFinite(y)) return null;
    last = w * last + (1 - w) * y;
    debias = w * debias + (1 - w);
    return last / debias;
  });
}

/* an opaque colour between `hex` and white (stacked areas must not blend into each other) */
export function tint(hex, amount) {
  const n = parseInt(hex.slice(1), 16);
  const mix = (c) => Math.round(c + (255 - c) * amount);
  return `rgb(${mix(n >> 16 & 255)},${mix(n >> 8 & 255)},${mix(n & 255)})`;
}

// -- the x axis: one choice for every chart of a page, remembered in the browser

// the steps between ticks of a count (steps, tokens): whole numbers only
const WHOLE = Array.from({ length: 16 }, (_, e) => [1, 2, 2.5, 5].map((m) => m * 10 ** e)).flat()
  .filter(Number.isInteger);

/* an axis' tick labels (uPlot's values(u, splits, axisIdx, space, incr)): see fmtTicks; a log axis' each alone */
export const axisFmt = (u, vals, i, space, incr) => fmtTicks(vals, u.scales[u.axes[i].scale].distr === 3 ? null : incr);

export const X_AXES = {
  step: { label: "step", fmt: fmtInt, ticks: axisFmt, incrs: WHOLE },
  tokens: { label: "tokens seen", fmt: (v) => fmtEng(v, 4), ticks: axisFmt, incrs: WHOLE },
  time: { label: "wall time", fmt: fmtDuration, ticks: (u, vals) => vals.map(fmtDuration) },
};
const X_KEY = "anectypes.x-axis";
export const xMode = () => (X_AXES[localStorage.getItem(X_KEY)] ? localStorage.getItem(X_KEY) : "step");
export const setXMode = (mode) => localStorage.setItem(X_KEY, mode);

/* the x values of metrics columns `m` (step, t) for a mode; seq: tokens per micro-step; null where unknown */
export function xValues(mode, m, seq) {
  if (mode === "tokens") return m.step.map((s) => (seq ? s * seq : null));
  if (mode === "time") {
    const t0 = (m.t || []).find(Number.isFinite);
    return m.step.map((s, i) => (Number.isFinite(m.t?.[i]) ? m.t[i] - t0 : null));
  }
  return m.step.slice();
}

// -- metrics columns ({step: [...], loss: [...], ...}: a run's /metrics answer) growing live

export const MAX_POINTS = 6000;   // client-side cap; beyond it the server down-samples the run again (condense)
export const ZOOM_POINTS = 5000;  // a zoomed range's rows, fetched whole up to this many

/* rows of a metrics event ({step, each metric}) added to the columns `m` */
export function appendRows(m, rows) {
  const keys = Object.keys(m);
  for (const row of rows) {
    const n = m.step.length;
    if (n && row.step === m.step[n - 1]) {
      // the same step again, now with its validation loss
      for (const k of keys) m[k][n - 1] = row[k];
      continue;
    }
    if (n && row.step < m.step[n - 1]) {
      // a replay or a resume that re-produces steps: drop what it overwrites
      let i = n;
      while (i > 0 && m.step[i - 1] >= row.step) i--;
      for (const k of keys) m[k].length = i;
    }
    for (const k of keys) m[k].push(row[k]);
  }
}

const condensing = new WeakSet();

/* past MAX_POINTS rows, the columns `m` replaced in place by `fetch()`'s (the server's down-sampling keeps
   every bucket's extremes, where thinning here would drop a spike), then the rows that arrived meanwhile;
   resolves true when it did */
export async function condense(m, fetch) {
  if (m.step.length <= MAX_POINTS || condensing.has(m)) return false;
  condensing.add(m);
  try {
    const fresh = await fetch(), since = fresh.step.at(-1) ?? -Infinity, keys = Object.keys(m);
    const later = [...m.step.keys()].filter((i) => m.step[i] >= since)
      .map((i) => Object.fromEntries(keys.map((k) => [k, m[k][i]])));
    for (const k of keys) m[k] = fresh[k];
    appendRows(m, later);
    return true;
  } finally {
    condensing.delete(m);
  }
}

/* [x, ...columns] keeping the rows where x (and, with `sparse`, the first column) is a number */
export function rowsWithX(x, cols, sparse = false) {
  const keep = x.map((v, i) => i).filter((i) => Number.isFinite(x[i]) && (!sparse || Number.isFinite(cols[0][i])));
  return [keep.map((i) => x[i]), ...cols.map((c) => keep.map((i) => c[i] ?? null))];
}

// -- colours from the page's theme (style.css)

const cssVar = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
const FONT = "11px system-ui, -apple-system, 'Segoe UI', sans-serif";

export function axis(more = {}) {
  return { stroke: cssVar("--chart-text"), grid: { stroke: cssVar("--chart-grid"), width: 1 },
    ticks: { stroke: cssVar("--chart-grid"), width: 1 }, font: FONT, labelFont: FONT, ...more };
}

const chartWidth = (node) => Math.max(200, Math.floor(node.clientWidth || node.parentNode.clientWidth || 400));
const chartHeight = (node) => (node.classList.contains("chart-tall") ? 300 : 190);

/* with the cursor off the chart the legend shows the latest values instead of dashes */
export function legendLast(u) {
  if (u.cursor.idx !== null && u.cursor.idx !== undefined) return;
  const n = u.data && u.data[0] ? u.data[0].length : 0;
  if (n) u.setLegend({ idx: n - 1 });
}

/* a box by the cursor with the x value and every series' value there, on the chart the mouse is over */
function tooltip() {
  let tip = null, hovered = false;
  const show = (u) => {
    const i = u.cursor.idx;
    if (!hovered || i === null || i === undefined) { tip.hidden = true; return; }
    tip.replaceChildren(...u.series.map((s, k) => el("div", { "data-series": k },
      [el("span", { className: "tip-label", text: s.label }), " ", el("b", { text: s.value(u, u.data[k][i], k, i) })])));
    tip.hidden = false;
    const left = u.cursor.left + 14, top = u.cursor.top + 10;
    tip.style.left = `${left + tip.offsetWidth > u.over.clientWidth ? u.cursor.left - tip.offsetWidth - 14 : left}px`;
    tip.style.top = `${Math.max(0, Math.min(top, u.over.clientHeight - tip.offsetHeight))}px`;
  };
  return { hooks: {
    init: (u) => {
      tip = el("div", { className: "chart-tip", role: "tooltip" });
      tip.hidden = true;
      u.over.append(tip);
      u.over.addEventListener("mouseenter", () => { hovered = true; });
      u.over.addEventListener("mouseleave", () => { hovered = false; tip.hidden = true; });
    },
    setCursor: show,
  } };
}

/* the legend's series names, which a click shows or hides, as toggle buttons for the keyboard too */
function legendKeys() {
  let labels = [];
  const pressed = (u) => labels.forEach((b, k) => b.setAttribute("aria-pressed", String(u.series[k + 1].show)));
  return { hooks: {
    init: (u) => {
      labels = [...u.root.querySelectorAll(".u-legend .u-series .u-label")].slice(1);    // (the first: x)
      for (const b of labels) {
        b.tabIndex = 0;
        b.setAttribute("role", "button");
        b.addEventListener("keydown", (e) => {
          if (e.key === "Enter" || e.key === " ") { e.preventDefault(); b.click(); }
        });
      }
      pressed(u);
    },
    setSeries: pressed,
  } };
}

/* a chart of `series` in `node`; opts: the x mode (`x`, an X_AXES key or such an axis), a log y scale (`log`), the y axis' options
   (`y`), and uPlot options over the defaults */
export function makeChart(node, series, { x = "step", log = false, y = {}, ...opts } = {},
  data = [[], ...series.map(() => [])]) {
  node.textContent = "";
  const X = X_AXES[x] || x;      // (or an axis of its own: {label, fmt, ticks})
  const scales = opts.scales || { x: { time: false } };
  return new uPlot({
    width: chartWidth(node),
    height: chartHeight(node),
    axes: [axis({ space: 60, values: X.ticks, incrs: X.incrs }), axis({ values: axisFmt, size: 56, ...y })],
    series: [{ label: X.label, value: (u, v) => X.fmt(v) }, ...series],
    legend: { live: true },
    cursor: { drag: { x: true, y: false }, points: { size: 6 } },
    hooks: { setCursor: [legendLast], setData: [legendLast] },
    plugins: [tooltip(), legendKeys()],
    ...opts,
    scales: { ...scales, y: { ...scales.y, ...(log ? { distr: 3, log: 10 } : {}) } },
  }, data, node);
}

export function line(label, color, more = {}) {
  return { label, stroke: color, width: 1.5, points: { show: false }, spanGaps: true,
    value: (u, v) => fmt(v, 4), ...more };
}

/* a series' points.filter: the dots of its shown points at least `gap` px apart (a long run's validation
   dots would cover the training curve; the line still joins every point) */
export function spacedDots(gap) {
  return (u, si, show) => {
    if (!show) return null;
    const xs = u.data[0], ys = u.data[si], [i0, i1] = u.series[0].idxs, keep = [];
    let last = -Infinity;
    for (let i = i0; i <= i1; i++) {
      if (ys[i] === null || ys[i] === undefined) continue;
      const px = u.valToPos(xs[i], "x");
      if (px - last >= gap) { keep.push(i); last = px; }
    }
    return keep;
  };
}

/* a zoomed range's full-resolution columns `detail` laid over the columns `m` (each: {step: [...], key:
   [...]}, in step order): m's rows before and after the detail's steps, the detail's in between */
export function overlay(m, detail) {
  if (!detail?.step.length) return m;
  const lo = detail.step[0], hi = detail.step.at(-1);
  const before = m.step.findIndex((s) => s >= lo), after = m.step.findIndex((s) => s > hi);
  const a = before < 0 ? m.step.length : before, b = after < 0 ? m.step.length : after;
  return Object.fromEntries(Object.keys(m).map((k) => [k, [...m[k].slice(0, a), ...detail[k], ...m[k].slice(b)]]));
}

/* the steps to fetch for an x range: from the last step drawn before it to the first after it (so the
   lines run to the chart's edges), in any x mode; xs: the x values of `steps` */
export function stepRange(steps, xs, [lo, hi]) {
  let first = steps[0], last = steps.at(-1);
  for (let i = 0; i < steps.length; i++) {
    if (!Number.isFinite(xs[i])) continue;
    if (xs[i] < lo) first = steps[i];
    else if (xs[i] > hi) { last = steps[i]; break; }
  }
  return [first, last];
}

/* charts: [{node, plot}] */
export function resizeAll(charts) {
  for (const { node, plot } of charts) {
    const w = chartWidth(node);
    if (Math.abs(w - plot.width) > 1) plot.setSize({ width: w, height: chartHeight(node) });
  }
}

// -- downloads

export function download(name, blob) {
  const a = el("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 60_000);
}

/* a chart's data as CSV: the x column and each series (or `columns` in their place) */
export function chartCsv(plot, columns = plot.data.slice(1)) {
  const cols = [plot.data[0], ...columns];
  const lines = [plot.series.map((s) => JSON.stringify(s.label)).join(",")];
  for (let i = 0; i < cols[0].length; i++) lines.push(cols.map((c) => c[i] ?? "").join(","));
  return new Blob([lines.join("\n") + "\n"], { type: "text/csv" });
}

/* a run's colour from its id alone, so that adding a run recolours no other (the same in the list, the
   comparison and its legend): FNV-1a, then murmur3's finaliser (ids differing in their last letter got
   hues 2° apart without it), picks one of 12 hues 30° apart in one of 3 shades */
export function runColor(id) {
  let h = 0x811c9dc5;
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 0x01000193);
  h = Math.imul(h ^ (h >>> 16), 0x85ebca6b);
  h = Math.imul(h ^ (h >>> 13), 0xc2b2ae35);
  const slot = ((h ^ (h >>> 16)) >>> 0) % 36;
  return `hsl(${(slot % 12) * 30 + 15}, 70%, ${[36, 47, 58][Math.floor(slot / 12)]}%)`;
}

const TITLE_FONT = "bold 14px system-ui, -apple-system, 'Segoe UI', sans-serif";

/* where a chart's picture puts its parts, in CSS px: the title above, the y axis' name left of the plot,
   the x axis' name under it, then the legend, a line per series shown (its colour, dash and label) */
function pictureLayout(plot, { title, y }) {
  const pad = 12, line = 18, top = pad + 22;
  const legend = plot.series.slice(1).map((s, k) => ({ label: s.label, dash: s.dash,
    color: typeof s.stroke === "function" ? s.stroke(plot, k + 1) : s.stroke })).filter((s, k) => plot.series[k + 1].show);
  const w = plot.width + pad * 2 + line, h = top + plot.height + line + pad + legend.length * line;
  return { w, h, pad, line, top, title, y, x: plot.series[0].label, legend,
    legendAt: (k) => top + plot.height + line + 6 + k * line };
}

/* a chart's picture as a PNG blob: on the card's background its title, axes' names and legend around
   the plot (a picture alone would not say what it shows) */
export function chartPng(plot, desc) {
  const L = pictureLayout(plot, desc), src = plot.ctx.canvas, r = src.width / plot.width;
  const out = el("canvas", { width: Math.round(L.w * r), height: Math.round(L.h * r) }), ctx = out.getContext("2d");
  ctx.scale(r, r);
  ctx.fillStyle = cssVar("--card");
  ctx.fillRect(0, 0, L.w, L.h);
  ctx.drawImage(src, L.pad + L.line, L.top, plot.width, plot.height);
  ctx.fillStyle = cssVar("--chart-text");
  ctx.textBaseline = "middle";
  ctx.font = TITLE_FONT;
  ctx.fillText(L.title, L.pad, L.pad + 8);
  ctx.font = FONT;
  ctx.textAlign = "center";
  ctx.fillText(L.x, L.pad + L.line + plot.width / 2, L.top + plot.height + L.line / 2);
  ctx.save();
  ctx.translate(L.pad + 6, L.top + plot.height / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText(L.y, 0, 0);
  ctx.restore();
  ctx.textAlign = "left";
  L.legend.forEach((s, k) => {
    const yk = L.legendAt(k);
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 2;
    ctx.setLineDash(s.dash || []);
    ctx.beginPath();
    ctx.moveTo(L.pad, yk);
    ctx.lineTo(L.pad + 24, yk);
    ctx.stroke();
    ctx.fillText(s.label, L.pad + 32, yk);
  });
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

const xml = (t) => String(t).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

/* the same as an SVG blob: its title, axes' names and legend as text, the plot as an embedded image */
export function chartSvg(plot, desc) {
  const L = pictureLayout(plot, desc), color = xml(cssVar("--chart-text"));
  const text = (x, y, t, more = "") => `<text x="${x}" y="${y}" fill="${color}" dominant-baseline="middle" ${more}>${xml(t)}</text>`;
  const cy = L.top + plot.height / 2, font = "font-family=\"system-ui, sans-serif\" font-size=\"11\"";
  const parts = [
    `<svg xmlns="http://www.w3.org/2000/svg" width="${L.w}" height="${L.h}" viewBox="0 0 ${L.w} ${L.h}" ${font}>`,
    `<title>${xml(L.title)}</title>`,
    `<rect width="100%" height="100%" fill="${xml(cssVar("--card"))}"/>`,
    `<image x="${L.pad + L.line}" y="${L.top}" width="${plot.width}" height="${plot.height}" href="${plot.ctx.canvas.toDataURL("image/png")}"/>`,
    text(L.pad, L.pad + 8, L.title, 'font-size="14" font-weight="bold"'),
    text(L.pad + L.line + plot.width / 2, L.top + plot.height + L.line / 2, L.x, 'text-anchor="middle"'),
    text(L.pad + 6, cy, L.y, `text-anchor="middle" transform="rotate(-90 ${L.pad + 6} ${cy})"`),
    ...L.legend.map((s, k) => `<line x1="${L.pad}" x2="${L.pad + 24}" y1="${L.legendAt(k)}" y2="${L.legendAt(k)}" stroke="${xml(s.color)}" stroke-width="2"${s.dash ? ` stroke-dasharray="${s.dash.join(" ")}"` : ""}/>`
      + text(L.pad + 32, L.legendAt(k), s.label)),
    "</svg>",
  ];
  return new Blob([parts.join("\n") + "\n"], { type: "image/svg+xml" });
}

/* the CSV, PNG and SVG buttons (and, with `onLog`, a log-scale checkbox) of a chart card's head; picture():
   {plot, name (the file's, without extension), y (the y axis' name)} at the time of the click */
export function chartTools(head, title, { csv, picture, onLog, log = false }) {
  const button = (text, what, fn) => {
    const b = el("button", { type: "button", className: "tool", text, "aria-label": `${title}: download ${what}` });
    b.addEventListener("click", fn);
    return b;
  };
  const tools = el("div", { className: "chart-tools" });
  if (onLog) {
    const cb = el("input", { type: "checkbox", className: "log-y", checked: log });
    cb.addEventListener("change", () => onLog(cb.checked));
    tools.append(el("label", { className: "check" }, [cb, "log y"]));
  }
  const save = async (ext, make) => {
    const { plot, name, ...desc } = picture();
    download(`${name}.${ext}`, await make(plot, { title, ...desc }));
  };
  tools.append(button("CSV", "the data as CSV", csv), button("PNG", "the chart as PNG", () => save("png", chartPng)),
    button("SVG", "the chart as SVG", () => save("svg", chartSvg)));
  head.append(tools);
}
