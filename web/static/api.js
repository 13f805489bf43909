/* The dashboard's JSON API. Errors are {"detail": "..."}, or a validation error's
   {"detail": [{loc, msg}, ...]}; an ApiError carries their text. */

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function detailMessage(body, status) {
  const d = body?.detail;
  if (Array.isArray(d)) {
    return d.map((e) => {
      const loc = e.loc.filter((p) => p !== "body").join(".");
      return (loc ? `${loc}: ` : "") + e.msg;
    }).join("; ");
  }
  return d || `HTTP ${status}`;
}

/* GET or DELETE, or POST/PATCH a JSON body (the server refuses anything else); the answer's JSON
   (null for an empty one) */
export async function api(path, method = "GET", body = {}) {
  const opts = { method };
  if (method === "POST" || method === "PATCH") {
    opts.headers = { "Content-Type": "application/json" };
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  const data = await r.json().catch(() => null);   // (an unexpected 500 is plain text; a 204 is empty)
  if (!r.ok) throw new ApiError(r.status, detailMessage(data, r.status));
  return data;
}

/* POST a JSON body and read the answer's server-sent events as they arrive: onEvent(name, data)
   for each (data parsed from its one JSON line) */
export async function postEvents(path, body, onEvent) {
  const r = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                body: JSON.stringify(body) });
  if (!r.ok) {
    const data = await r.json().catch(() => null);
    throw new ApiError(r.status, detailMessage(data, r.status));
  }
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const field = (name) => lines.find((l) => l.startsWith(`${name}: `))?.slice(name.length + 2);
      onEvent(field("event"), JSON.parse(field("data")));
    }
  }
}

/* a run's server-sent events (GET /api/runs/{id}/events) from after step `since`: on[name](data) for
   each event named in `on` (data: its parsed JSON; for "open" and "error", the connection's own event).
   The EventSource is closed after "done". */
export function runEvents(runId, since, on) {
  const es = new EventSource(`/api/runs/${encodeURIComponent(runId)}/events?since_step=${encodeURIComponent(since)}`);
  for (const [name, fn] of Object.entries(on)) {
    es.addEventListener(name, (e) => fn(e instanceof MessageEvent ? JSON.parse(e.data) : e));
  }
  es.addEventListener("done", () => es.close());
  return es;
}
