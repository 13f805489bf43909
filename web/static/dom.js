/* DOM helpers. The CSP forbids inline style attributes: styles are set through classes or the CSSOM
   (element.style), never through markup. */

export const $ = (sel, root = document) => root.querySelector(sel);
export const $all = (sel, root = document) => [...root.querySelectorAll(sel)];

/* an element: attrs `text` (its text), `className`, any other attribute (null, undefined, false: left
   out; true: present); children are nodes or strings */
export function el(tag, attrs = {}, children = []) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") e.textContent = v;
    else if (k === "className") e.className = v;
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  e.append(...children);
  return e;
}

/* a run state badge */
export function setState(node, state) {
  node.textContent = state || "unknown";
  node.setAttribute("data-state", state || "");
  node.className = `state state-${state || "unknown"}`;
}

export function debounce(fn, ms) {
  let t = null;
  return () => { clearTimeout(t); t = setTimeout(fn, ms); };
}
