/* A page's view (the runs compared, filters, sort, zoom, smoothing, the x axis, log scales) kept in its
   URL's query, so that a reload or a pasted link shows the same view. */

/* the URL's query as {name: value} */
export const readView = () => Object.fromEntries(new URLSearchParams(window.location.search));

/* `view` as the URL's query, without a new history entry; null, undefined, "" and false are left out */
export function writeView(view) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(view)) {
    if (v !== null && v !== undefined && v !== "" && v !== false) q.set(k, v === true ? "1" : String(v));
  }
  const query = q.toString();
  window.history.replaceState(window.history.state, "", query ? `?${query}` : window.location.pathname);
}

/* "lo,hi" as [lo, hi] (lo < hi), else null; and back */
export function parseRange(text) {
  const r = (text || "").split(",").map((s) => (s.trim() ? Number(s) : NaN));
  return r.length === 2 && r.every(Number.isFinite) && r[0] < r[1] ? r : null;
}
export const formatRange = (r) => (r ? r.map((v) => String(v)).join(",") : null);

/* a smoothing weight in [0, 0.999], else `fallback` */
export function parseSmoothing(text, fallback) {
  const w = text === undefined || text.trim() === "" ? NaN : Number(text);
  return Number.isFinite(w) ? Math.min(0.999, Math.max(0, w)) : fallback;
}
