/* How values are shown: "–" for a missing one. Times are Unix seconds, as the API sends them. */

export function fmt(v, digits) {
  if (typeof v !== "number" || !isFinite(v)) return "–";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e6 || a < 1e-3) return v.toExponential(digits === undefined ? 2 : Math.max(1, digits - 1));
  if (Number.isInteger(v)) return String(v);
  return String(parseFloat(v.toPrecision(digits || 4)));
}

const ENG = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];

/* engineering notation from 1,000 up: 1.5k, 1M, 2.05G (`digits` significant digits at most) */
export function fmtEng(v, digits = 3) {
  if (typeof v !== "number" || !isFinite(v)) return "–";
  const [unit, suffix] = ENG.find(([u]) => Math.abs(v) >= u) || [1, ""];
  return `${parseFloat((v / unit).toPrecision(digits))}${suffix}`;
}

/* the decimals that write `x` exactly (at most 12): 0.25 -> 2, 2.5 -> 1, 5 -> 0 */
function decimals(x) {
  let d = 0;
  while (d < 12 && Math.abs(Math.round(x * 10 ** d) - x * 10 ** d) > 1e-6) d++;
  return d;
}

/* an axis' tick labels: ticks `incr` apart, each written with the decimals the step needs (so no two read
   the same), in engineering notation from 10,000 up (1.5M) and as 2.5e-4 below 0.001; without `incr` (a
   log axis) each on its own; a tick left unlabelled (null) stays blank */
export function fmtTicks(vals, incr) {
  const top = Math.max(...vals.map((v) => Math.abs(v ?? 0)));
  return vals.map((v) => {
    if (v === null || v === undefined) return "";
    if (v === 0) return "0";
    if (!incr) return top >= 1e4 ? fmtEng(v) : fmt(v, 3);
    if (top >= 1e4) {
      const [unit, suffix] = ENG.find(([u]) => top >= u);
      return `${parseFloat((v / unit).toFixed(decimals(incr / unit)))}${suffix}`;
    }
    if (top < 1e-3) return Number(v.toPrecision(Math.ceil(Math.log10(top / incr)) + 1)).toExponential();
    return String(parseFloat(v.toFixed(decimals(incr))));
  });
}

export function fmtInt(v) {
  if (typeof v !== "number" || !isFinite(v)) return "–";
  return Math.round(v).toLocaleString("en-US");
}

/* seconds as "42 s", "3m05s", "2h07m" */
export function fmtDuration(s) {
  if (typeof s !== "number" || !isFinite(s)) return "–";
  const h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60, sec = Math.round(s % 60);
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${fmt(s, 3)} s`;
}

export function fmtBytes(n) {
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

const toDate = (seconds) => (typeof seconds === "number" ? new Date(seconds * 1000) : null);

export function fmtAgo(seconds) {
  const d = toDate(seconds);
  if (!d) return "–";
  const s = (Date.now() - d.getTime()) / 1000;
  if (s < 5) return "just now";
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return d.toLocaleDateString();
}

export function fmtDate(seconds) {
  const d = toDate(seconds);
  return d ? d.toLocaleString() : "–";
}

/* a config value */
export function fmtValue(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

/* nested objects as one level of dotted names: {spec: {lr: 1}} -> {"spec.lr": 1} */
export function flatten(obj, prefix = "", out = {}) {
  for (const [k, v] of Object.entries(obj)) {
    const key = prefix ? `${prefix}.${k}` : k;
    if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, key, out);
    else out[key] = v;
  }
  return out;
}
