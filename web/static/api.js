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

/* GET, or POST a JSON body (the server refuses anything else); the answer's JSON */
export async function api(path, method = "GET", body = {}) {
  const opts = { method };
  if (method !== "GET") {
    opts.headers = { "Content-Type": "application/json" };
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  const data = await r.json().catch(() => null);   // (an unexpected 500 is plain text)
  if (!r.ok) throw new ApiError(r.status, detailMessage(data, r.status));
  return data;
}
