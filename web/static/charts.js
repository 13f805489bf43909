/* Charts on the vendored uPlot (the global `uPlot`, loaded by a classic script before the modules). */

import { fmt, fmtInt } from "./format.js";

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

export const axisFmt = (u, vals) => vals.map((v) => fmt(v, 3));

export const AXIS = { stroke: "#495057", grid: { stroke: "#e9ecef", width: 1 }, ticks: { stroke: "#dee2e6", width: 1 },
  font: "11px system-ui, -apple-system, 'Segoe UI', sans-serif" };

/* the x axis and a y axis (with `y` over the defaults) */
export const axes = (y = {}) => [{ ...AXIS, space: 60 }, { ...AXIS, values: axisFmt, size: 56, ...y }];

const chartWidth = (node) => Math.max(200, Math.floor(node.clientWidth || node.parentNode.clientWidth || 400));
const chartHeight = (node) => (node.classList.contains("chart-tall") ? 300 : 190);

/* with the cursor off the chart the legend shows the latest values instead of dashes */
export function legendLast(u) {
  if (u.cursor.idx !== null && u.cursor.idx !== undefined) return;
  const n = u.data && u.data[0] ? u.data[0].length : 0;
  if (n) u.setLegend({ idx: n - 1 });
}

/* a chart of `series` over the steps in `node`; `opts` replace the defaults' top-level options */
export function makeChart(node, series, opts = {}, data = [[], ...series.map(() => [])]) {
  node.textContent = "";
  return new uPlot({
    width: chartWidth(node),
    height: chartHeight(node),
    scales: { x: { time: false } },
    axes: axes(),
    series: [{ label: "step", value: (u, v) => fmtInt(v) }, ...series],
    legend: { live: true },
    cursor: { drag: { x: true, y: false }, points: { size: 6 } },
    hooks: { setCursor: [legendLast], setData: [legendLast] },
    ...opts,
  }, data, node);
}

export function line(label, color, more = {}) {
  return { label, stroke: color, width: 1.5, points: { show: false }, spanGaps: true,
    value: (u, v) => fmt(v, 4), ...more };
}

/* charts: [{node, plot}] */
export function resizeAll(charts) {
  for (const { node, plot } of charts) {
    const w = chartWidth(node);
    if (Math.abs(w - plot.width) > 1) plot.setSize({ width: w, height: chartHeight(node) });
  }
}
