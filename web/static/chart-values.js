/* A chart's values for the keyboard and screen readers (a canvas shows them to the eye only): under the
   chart, a "Values" disclosure with each series' first, last, lowest and highest value and where each is,
   filled while it is open. */

import { el } from "./dom.js";

/* the disclosure, put after the chart's node */
export function chartValues(node, title) {
  const details = el("details", { className: "chart-values" }, [
    el("summary", {}, ["Values", el("span", { className: "sr-only", text: ` of ${title}` })]),
    el("table", { className: "data-table" }),
  ]);
  node.after(details);
  return details;
}

/* its table from a uPlot chart: the x column and each series (or `columns` in their place), each value
   as the chart's legend shows it */
export function showValues(details, plot, columns) {
  if (!details.open || !plot) return;
  columns ||= plot.data.slice(1);
  const xs = plot.data[0], x = plot.series[0];
  const rows = plot.series.slice(1).map((s, k) => {
    const ys = columns[k], found = { first: -1, last: -1, lowest: -1, highest: -1 };
    ys.forEach((y, i) => {
      if (!Number.isFinite(y)) return;
      if (found.first < 0) found.first = i;
      found.last = i;
      if (found.lowest < 0 || y < ys[found.lowest]) found.lowest = i;
      if (found.highest < 0 || y > ys[found.highest]) found.highest = i;
    });
    const cell = (i) => el("td", { text: i < 0 ? "–" : `${s.value(plot, ys[i], k + 1, i)} at ${x.value(plot, xs[i])}` });
    return el("tr", {}, [el("th", { scope: "row", text: s.label }), ...Object.values(found).map(cell)]);
  });
  const head = el("tr", {}, ["series", "first", "last", "lowest", "highest"].map((t) => el("th", { scope: "col", text: t })));
  const caption = el("caption", { text: xs.length
    ? `${xs.length} points, ${x.label} ${x.value(plot, xs[0])} to ${x.value(plot, xs.at(-1))}` : "no points yet" });
  details.querySelector("table").replaceChildren(caption, el("thead", {}, [head]), el("tbody", {}, rows));
}
