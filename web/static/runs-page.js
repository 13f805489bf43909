/* The runs page: the runs list, the start form, and the comparison of selected runs. */

import { api, runEvents } from "./api.js";
import { X_AXES, ZOOM_POINTS, axisFmt, appendRows, chartCsv, chartTools, condense, download, legendLast, line,
  makeChart, overlay, resizeAll, rowsWithX, runColor, setXMode, smooth, stepRange, xMode, xValues } from "./charts.js";
import { chartValues, showValues } from "./chart-values.js";
import { $, $all, debounce, el, setState } from "./dom.js";
import { flatten, fmt, fmtAgo, fmtDate, fmtDuration, fmtInt, fmtValue } from "./format.js";
import { formatRange, parseRange, parseSmoothing, readView, writeView } from "./view.js";

const FIELD_ORDER = ["meta.", "model_name", "spec.", "model.", "params", "active_vocab", "device"];

/* where a config field goes in the comparison table: FIELD_ORDER's place, the rest after it */
function fieldRank(k) {
  const i = FIELD_ORDER.findIndex((f) => k === f || (f.endsWith(".") && k.startsWith(f)));
  return i < 0 ? FIELD_ORDER.length : i;
}

const LIVE = ["running", "restarting"];
const MAX_STREAMS = 4;    // live runs followed in the comparison (a browser opens 6 connections to a host)

const runHref = (id) => `/runs/${encodeURIComponent(id)}`;
const metricsUrl = (id) => `/api/runs/${encodeURIComponent(id)}/metrics?since_step=-1&max_points=2000`;
const runLabel = (id, meta) => (meta?.name ? `${meta.name} (${id})` : id);

/* what a column sorts by (data-sort of its header) */
const SORT_VALUE = {
  name: (r) => (r.meta.name || r.id).toLowerCase(),
  progress: (r) => (r.steps ? (r.step || 0) / r.steps : -1),
};
const sortValue = (key) => SORT_VALUE[key] || (key.startsWith("spec.") ? (r) => r.spec[key.slice(5)] : (r) => r[key]);

/* a colour swatch of a run (runColor) */
function swatch(id) {
  const sw = el("span", { className: "swatch", "aria-hidden": "true" });
  sw.style.background = runColor(id);
  return sw;
}

export class RunsPage {
  constructor() {
    this.presets = null;   // GET /api/presets: the form's choices and defaults
    this.rows = new Map();   // run id -> its table row
    this.selected = new Set();
    this.compareChart = null;
    this.compareData = null;
    this.compareStreams = [];   // the event streams of the compared runs that are running
    this.runs = [];          // the last GET /api/runs
    this.sort = null;        // {key, dir}: a column header's order; null: newest first (the server's)
    this.view = readView();  // a link's or a reload's view, applied as the runs and the presets arrive
    this.compared = [];      // the ids compared
    this.compareZoom = null; // [min, max] x of a drag selection on the comparison
    this.columns = [];       // the run spec's fields shown as columns of the list (chosen, in the URL)
  }

  start() {
    this.bindForm();
    this.restoreView();
    const loaded = [this.loadPresets(), this.loadRuns()];
    setInterval(() => { if (!document.hidden) this.loadRuns(); }, 3000);
    $("#compare-btn").addEventListener("click", () => { this.compareZoom = null; this.compare(); });
    this.bindFilters();
    this.showColumns();
    const showSmoothing = () => {
      $("#compare-smoothing-value").textContent = parseFloat($("#compare-smoothing").value).toFixed(3);
    };
    showSmoothing();
    $("#compare-smoothing").addEventListener("input", () => { showSmoothing(); this.redrawCompare(); this.saveView(); });
    $("#compare-x").addEventListener("change", (ev) => {
      setXMode(ev.target.value);
      this.zoomCompare(null);
      this.drawCompare();
    });
    $("#compare-sample-step").addEventListener("input", (ev) => {
      const steps = this.compareSampleSteps(), i = Number(ev.target.value);
      this.compareSample = i < steps.length - 1 ? steps[i] : null;     // at the right end it follows new samples
      this.renderCompareSamples();
      this.saveView();
    });
    for (const sel of ["#scatter-x", "#scatter-y"]) {
      $(sel).addEventListener("change", () => { this.drawScatter(); this.saveView(); });
    }
    for (const sel of ["#compare-metric", "#compare-val"]) {
      $(sel).addEventListener("change", () => { this.drawCompare(); this.saveView(); });
    }
    chartTools($("#compare-section .card-head"), "Compare", { log: this.compareLog,
      onLog: (on) => { this.compareLog = on; this.drawCompare(); this.saveView(); },
      csv: () => download(`compare-${$("#compare-metric").value}.csv`, chartCsv(this.compareChart)),
      picture: () => ({ plot: this.compareChart, name: `compare-${$("#compare-metric").value}`,
        title: `Compare: ${$("#compare-metric").value}`, y: $("#compare-metric").value }) });
    this.compareValues = chartValues($("#compare-chart"), "the comparison");
    this.compareValues.addEventListener("toggle", () => showValues(this.compareValues, this.compareChart));
    document.addEventListener("themechange", () => { this.drawCompare(); this.drawScatter(); });
    $("#diff-only").addEventListener("change", (ev) => {
      $("#config-diff").classList.toggle("only-diff", ev.target.checked);
    });
    window.addEventListener("resize", debounce(() => {
      if (this.compareChart) resizeAll([{ node: $("#compare-chart"), plot: this.compareChart }]);
    }, 150));
    Promise.all(loaded).then(() => {       // a link's comparison, once its runs are listed
      const ids = (this.view.compare || "").split(",").filter((id) => this.runs.some((r) => r.id === id));
      if (ids.length < 2) return;
      for (const id of ids) {
        this.selected.add(id);
        const cb = this.rows.get(id)?.querySelector("input.compare-select");
        if (cb) cb.checked = true;
      }
      this.compare(ids);
    });
  }

  // -- the view in the URL

  /* the controls set from the URL's view (the filters with a choice not listed yet: in fillFilters) */
  restoreView() {
    const v = this.view;
    $("#filter-text").value = v.q || "";
    $("#show-archived").checked = v.archived === "1";
    this.wanted = { "#filter-state": v.state, "#filter-model": v.model, "#filter-tag": v.tag };
    if (v.sort) this.sort = { key: v.sort.replace(/^-/, ""), dir: v.sort.startsWith("-") ? -1 : 1 };
    $("#compare-x").value = X_AXES[v.x] ? v.x : xMode();
    $("#compare-val").checked = v.val !== "0";
    $("#compare-smoothing").value = String(parseSmoothing(v.smooth, parseFloat($("#compare-smoothing").value)));
    this.compareLog = v.log === "1";
    this.compareZoom = parseRange(v.zoom);
    this.columns = [...new Set((v.cols || "").split(",").filter(Boolean))];
    this.compareSample = v.sample && Number.isInteger(Number(v.sample)) ? Number(v.sample) : null;   // null: the latest
  }

  saveView() {
    const ids = this.compared;
    writeView({ q: $("#filter-text").value.trim(), state: $("#filter-state").value, model: $("#filter-model").value,
      tag: $("#filter-tag").value, archived: $("#show-archived").checked, cols: this.columns.join(","),
      sort: this.sort && `${this.sort.dir < 0 ? "-" : ""}${this.sort.key}`,
      ...(ids.length ? { compare: ids.join(","), metric: $("#compare-metric").value, val: !$("#compare-val").checked && "0",
        x: $("#compare-x").value, smooth: $("#compare-smoothing").value, log: this.compareLog,
        zoom: formatRange(this.compareZoom), setting: $("#scatter-x").value, value: $("#scatter-y").value !== "best" && "final",
        sample: this.compareSample }
        : {}) });
  }

  // -- the start form

  /* the choices, and every default as the placeholder of its field: the run spec's defaults, and for
     steps, lr, accum and warmup the selected preset's schedule (all from /api/presets) */
  async loadPresets() {
    const form = $("#start-form");
    try {
      const p = await api("/api/presets");
      this.presets = p;
      $("#compare-metric").replaceChildren(...p.metric_keys.filter((k) => k !== "t" && k !== "val_loss")
        .map((k) => el("option", { value: k, text: k })));
      if (p.metric_keys.includes(this.view.metric)) $("#compare-metric").value = this.view.metric;
      const choose = (name, values, titles = {}) => {
        const s = form.elements[name];
        s.replaceChildren(...values.map((v) => el("option", { value: v, text: v, title: titles[v] })));
        s.value = p.defaults[name];
      };
      const desc = {};
      for (const [n, d] of Object.entries(p.presets)) {
        desc[n] = `dim ${d.dim}, ${d.layers} layers, ${d.heads} heads, seq ${d.seq}`;
      }
      choose("model", Object.keys(p.presets), desc);
      choose("backend", p.backends);
      choose("precision", p.precisions);
      for (const name of ["dynamic_loss_scale", "exact_accum"]) form.elements[name].checked = p.defaults[name];
      $("#data-hint").textContent = `Data and tokenizer: files in ${p.data_dir} (the dashboard's --data-dir; `
        + "a name alone is taken from there).";
      this.showDefaults();
    } catch (e) {
      const msg = $("#start-message");
      msg.className = "message error";
      msg.textContent = `Could not load the presets: ${e.message}`;
    }
  }

  showDefaults() {
    const p = this.presets, form = $("#start-form");
    const schedule = p.schedules[form.elements.model.value] || {};
    for (const inp of $all("input[type=number], input[type=text]", form)) {
      const v = inp.name in schedule ? schedule[inp.name] : p.defaults[inp.name];
      if (v !== null && v !== undefined) inp.placeholder = String(v);
    }
  }

  bindForm() {
    const form = $("#start-form"), msg = $("#start-message");
    form.elements.model.addEventListener("change", () => { if (this.presets) this.showDefaults(); });
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const body = {}, grid = {};
      let bad = null;
      for (const inp of $all("input[name], select[name]", form)) {
        const name = inp.name, v = inp.value.trim();
        if ("sweep" in inp.dataset && v !== "") {
          // one number, or several (a sweep's grid)
          const values = v.split(/[\s,]+/).filter(Boolean).map(Number);
          if (!values.every(isFinite)) bad ||= name;
          else if (values.length > 1) grid[name] = values;
          else body[name] = values[0];
        } else if (inp.type === "checkbox") {
          if (this.presets && inp.checked !== this.presets.defaults[name]) body[name] = inp.checked;
        } else if (inp.validity.badInput) {
          bad ||= name;           // (its value reads as "")
        } else if (v === "") {
          // a field left blank takes its default (the placeholder)
        } else if (inp.type === "number") {
          const n = Number(v);    // the server checks the type and range (422 naming the field)
          if (isFinite(n)) body[name] = n; else bad ||= name;
        } else {
          body[name] = v;
        }
      }
      if (bad) { msg.className = "message error"; msg.textContent = `${bad}: not a valid number`; return; }
      const btn = $("#start-btn");
      btn.disabled = true;
      msg.className = "message";
      msg.textContent = "starting…";
      try {
        if (Object.keys(grid).length) {
          const r = await api("/api/sweeps", "POST", { ...body, grid });
          await this.loadRuns();
          $("#filter-tag").value = `sweep-${r.sweep}`;     // its runs, ready to compare
          this.renderRuns();
          this.saveView();
          msg.textContent = `sweep ${r.sweep}: ${r.ids.length} runs`;
          btn.disabled = false;
          return;
        }
        const r = await api("/api/runs", "POST", body);
        msg.textContent = `started ${r.id}`;
        window.location.href = runHref(r.id);
      } catch (e) {
        btn.disabled = false;
        msg.className = "message error";
        msg.textContent = e.message;
      }
    });
  }

  // -- the runs list: filtered and sorted here, from the whole list

  bindFilters() {
    for (const id of ["#filter-text", "#filter-state", "#filter-model", "#filter-tag"]) {
      $(id).addEventListener("input", () => { this.renderRuns(); this.saveView(); });
    }
    $("#show-archived").addEventListener("change", () => { this.loadRuns(); this.saveView(); });
    $("#select-shown").addEventListener("change", (ev) => {
      for (const cb of $all("#runs-table tbody input.compare-select")) {
        cb.checked = ev.target.checked;
        cb.dispatchEvent(new Event("change"));
      }
    });
    for (const th of $all("#runs-table th[data-sort]")) this.sortButton(th);
    this.showSort();
  }

  showSort() {
    for (const h of $all("#runs-table th[data-sort]")) h.removeAttribute("aria-sort");
    const th = this.sort && $(`#runs-table th[data-sort="${CSS.escape(this.sort.key)}"]`);
    th?.setAttribute("aria-sort", this.sort.dir > 0 ? "ascending" : "descending");
  }

  /* a column header's text made a button that sorts by it (again: the other way) */
  sortButton(th) {
    const b = el("button", { type: "button", className: "sort", text: th.textContent });
    th.replaceChildren(b);
    b.addEventListener("click", () => {
      const key = th.dataset.sort;
      this.sort = { key, dir: this.sort?.key === key ? -this.sort.dir : 1 };
      this.showSort();
      this.renderRuns();
      this.saveView();
    });
  }

  /* the chooser of config columns: a checkbox per run-spec field the runs have (the chosen ones kept) */
  fillColumns() {
    const fields = [...new Set([...this.runs.flatMap((r) => Object.keys(r.spec)), ...this.columns])].sort();
    const box = $("#column-choices");
    if (fields.join("\n") === $all("input", box).map((c) => c.value).join("\n")) return;
    box.replaceChildren(...fields.map((f) => {
      const cb = el("input", { type: "checkbox", value: f, checked: this.columns.includes(f) });
      cb.addEventListener("change", () => {
        this.columns = $all("input:checked", box).map((c) => c.value);
        this.showColumns();
        this.renderRuns();
        this.saveView();
      });
      return el("label", { className: "check" }, [cb, f]);
    }));
  }

  /* the chosen columns' headers, before "Updated" */
  showColumns() {
    for (const th of $all("#runs-table thead th.col-spec")) th.remove();
    const updated = $("#runs-table thead th.col-updated");
    for (const f of this.columns) {
      const th = el("th", { className: "col-spec", "data-sort": `spec.${f}`, text: f });
      updated.before(th);
      this.sortButton(th);
    }
    this.showSort();
  }

  async loadRuns() {
    try {
      this.runs = (await api(`/api/runs${$("#show-archived").checked ? "?archived=true" : ""}`)).runs;
      this.fillFilters();
      this.fillColumns();
      this.renderRuns();
    } catch { /* polled again in 3 s */ }
  }

  /* each filter's choices, and the runs to fine-tune from: the values the runs have (the selection kept) */
  fillFilters() {
    const choices = { "#filter-state": this.runs.map((r) => r.state), "#filter-model": this.runs.map((r) => r.model_name),
      "#filter-tag": this.runs.flatMap((r) => r.meta.tags),
      "#start-form [name=init_from_run]": this.runs.filter((r) => ["finished", "stopped"].includes(r.state)).map((r) => r.id) };
    for (const [id, values] of Object.entries(choices)) {
      const sel = $(id), keep = sel.value || this.wanted[id];
      const opts = [...new Set(values.filter(Boolean))].sort();
      if (opts.join("\n") === $all("option", sel).slice(1).map((o) => o.value).join("\n")) continue;
      sel.replaceChildren(sel.options[0], ...opts.map((v) => el("option", { value: v, text: v })));
      sel.value = opts.includes(keep) ? keep : "";
    }
    this.wanted = {};
  }

  visibleRuns() {
    const text = $("#filter-text").value.trim().toLowerCase(), state = $("#filter-state").value;
    const model = $("#filter-model").value, tag = $("#filter-tag").value;
    const rows = this.runs.filter((r) => (!state || r.state === state) && (!model || r.model_name === model)
      && (!tag || r.meta.tags.includes(tag))
      && (!text || [r.id, r.meta.name, r.meta.notes, ...r.meta.tags].join("\n").toLowerCase().includes(text)));
    if (!this.sort) return rows;
    const { key, dir } = this.sort, value = sortValue(key);
    const rank = (v) => (v === null || v === undefined ? 1 : 0);      // missing values last, either way
    return rows.sort((a, b) => {
      const va = value(a), vb = value(b);
      return rank(va) - rank(vb) || (va < vb ? -dir : va > vb ? dir : 0);
    });
  }

  /* the row of a run, made once: its cells are filled in on every poll */
  row(run) {
    const cb = el("input", { type: "checkbox", className: "compare-select", value: run.id,
      "aria-label": `select ${run.id} for comparison` });
    cb.addEventListener("change", () => {
      if (cb.checked) this.selected.add(run.id); else this.selected.delete(run.id);
      this.updateCompareButton();
    });
    const td = (className, children) => el("td", { className }, children);
    // (its name begins with its visible text: voice control says "click Edit")
    const edit = el("button", { type: "button", className: "tool edit", text: "Edit",
      "aria-label": `Edit the name, tags and notes of ${run.id}` });
    edit.addEventListener("click", () => this.editRow(run.id));
    return el("tr", { "data-run-id": run.id }, [
      td("col-select", [el("label", { className: "hit" }, [cb])]),
      td("col-id", [swatch(run.id), el("a", { href: runHref(run.id) }), el("span", { className: "tags" }), edit,
        el("span", { className: "notes" })]),
      td("col-model"), td("col-state"), td("col-progress"), td("col-loss num"), td("col-best num"),
      td("col-duration num"), td("col-updated"),
    ]);
  }

  renderRuns() {
    const body = $("#runs-table tbody"), runs = this.visibleRuns();
    $("#runs-empty").hidden = this.runs.length > 0;
    const seen = new Set();
    runs.forEach((run, i) => {
      seen.add(run.id);
      if (!this.rows.has(run.id)) this.rows.set(run.id, this.row(run));
      const tr = this.rows.get(run.id), link = $(".col-id a", tr);
      link.textContent = run.meta.name || run.id;
      link.title = run.meta.name ? run.id : "";
      $(".col-id .tags", tr).replaceChildren(...run.meta.tags.map((t) => el("span", { className: "tag", text: t })));
      const notes = $(".col-id .notes", tr);
      notes.textContent = run.meta.notes;
      notes.title = run.meta.notes;
      $all("td.col-spec", tr).forEach((c) => c.remove());
      $(".col-updated", tr).before(...this.columns.map((f) => el("td", { className: "col-spec", text: fmtValue(run.spec[f]) })));
      tr.meta = run.meta;
      tr.classList.toggle("archived", run.meta.archived);
      $(".col-duration", tr).textContent = fmtDuration(run.duration);
      $(".col-model", tr).textContent = run.model_name || "–";
      const badge = el("span");
      setState(badge, run.state);
      if (run.error) badge.title = run.error;
      $(".col-state", tr).replaceChildren(badge);
      const pr = $(".col-progress", tr);
      if (run.state === "queued") {
        pr.replaceChildren(el("span", { className: "meta", text: `queued, #${run.position}` }));
      } else if (run.steps) {
        pr.replaceChildren(el("progress", { max: run.steps, value: Math.min(run.step || 0, run.steps) }),
          el("span", { className: "meta", text: `${fmtInt(run.step || 0)} / ${fmtInt(run.steps)}` }));
      } else pr.textContent = "–";
      $(".col-loss", tr).textContent = fmt(run.last_loss, 4);
      $(".col-best", tr).textContent = fmt(run.best_val_loss, 4);
      const up = $(".col-updated", tr);
      up.textContent = fmtAgo(run.updated || run.created);
      up.title = `created ${fmtDate(run.created)}\nupdated ${fmtDate(run.updated)}`;
      if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
    });
    for (const [id, tr] of this.rows) {
      if (!seen.has(id)) { tr.remove(); this.rows.delete(id); this.selected.delete(id); }
    }
    this.updateCompareButton();
  }

  /* the name, tags and notes of a run, edited in its row (PATCH; the list shows them on its next load) */
  editRow(id) {
    const tr = this.rows.get(id), cell = $(".col-id", tr), kept = [...cell.childNodes];
    const name = el("input", { type: "text", className: "edit-name", value: tr.meta.name, maxlength: 100,
      "aria-label": `name of ${id}` });
    const tags = el("input", { type: "text", className: "edit-tags", value: tr.meta.tags.join(" "),
      "aria-label": `tags of ${id}, separated by spaces` });
    const notes = el("textarea", { className: "edit-notes", text: tr.meta.notes, rows: 1, maxlength: 5000,
      "aria-label": `notes of ${id}` });
    const save = el("button", { type: "submit", text: "Save" }), cancel = el("button", { type: "button", text: "Cancel" });
    const form = el("form", { className: "row-edit" }, [name, tags, notes, save, cancel]);
    const close = () => cell.replaceChildren(...kept);
    cancel.addEventListener("click", close);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      try {
        await api(`/api/runs/${encodeURIComponent(id)}`, "PATCH",
          { name: name.value.trim(), tags: tags.value.split(/[\s,]+/).filter(Boolean), notes: notes.value });
        close();
        await this.loadRuns();
      } catch (e) { save.title = e.message; form.classList.add("error"); }
    });
    cell.replaceChildren(form);
    name.focus();
  }

  updateCompareButton() {
    const n = this.selected.size;
    $("#compare-btn").disabled = n < 2;
    $("#compare-hint").textContent = n < 2 ? "select two or more runs to compare" : `${n} runs selected`;
  }

  // -- the comparison

  async compare(ids = $all("input.compare-select:checked").map((c) => c.value)) {
    if (ids.length < 2) return;
    const section = $("#compare-section");
    section.hidden = false;
    $("#compare-title").textContent = `${ids.length} runs`;
    const focused = document.activeElement === $("#compare-btn");   // (disabled next, it loses the focus)
    $("#compare-btn").disabled = true;
    try {
      const runs = await Promise.all(ids.map(async (id) => {
        const base = `/api/runs/${encodeURIComponent(id)}`;
        const [run, metrics, { samples }] = await Promise.all([api(base), api(metricsUrl(id)), api(`${base}/samples`)]);
        return { id, run, metrics, samples: new Map(samples.map((smp) => [smp.step, smp.text])) };
      }));
      this.compareData = runs;
      this.compared = ids;
      this.drawCompare();
      this.zoomCompare(this.compareZoom);
      this.renderDiff(runs);
      this.fillScatter();
      this.renderCompareSamples();
      // the running runs' curves grow as their rows arrive
      for (const es of this.compareStreams) es.close();
      this.compareStreams = runs.filter((r) => LIVE.includes(r.run.state)).slice(0, MAX_STREAMS)
        .map((r) => runEvents(r.id, r.metrics.step.at(-1) ?? -1, {
          metrics: (d) => {
            appendRows(r.metrics, d.rows);
            this.redrawCompare();
            condense(r.metrics, () => api(metricsUrl(r.id))).then((done) => done && this.redrawCompare(), () => {});
          },
          sample: (smp) => { r.samples.set(smp.step, smp.text); this.renderCompareSamples(); } }));
      section.scrollIntoView({ behavior: "auto", block: "start" });
    } catch (e) {
      $("#compare-title").textContent = `failed: ${e.message}`;
    }
    if (focused) $("h2", section).focus();
    this.updateCompareButton();
  }

  /* the metric compared, and whether the runs' validation losses are drawn with it */
  compareMetric() {
    const key = $("#compare-metric").value || "loss";
    return { key, withVal: key === "loss" && $("#compare-val").checked };
  }

  /* the chart, made anew for the metric, the validation losses, the x axis, the log scale, the theme */
  drawCompare() {
    const runs = this.compareData, node = $("#compare-chart");
    if (!runs) return;
    const { key, withVal } = this.compareMetric();
    const series = runs.flatMap((r) => {
      const color = runColor(r.id), label = runLabel(r.id, r.run.meta);
      return [line(label, color, { width: 2 }),
        ...(withVal ? [line(`${label} validation`, color, { width: 1, dash: [4, 4], points: { show: true, size: 5 } })] : [])];
    });
    if (this.compareChart) this.compareChart.destroy();
    node.classList.add("chart-tall");
    // a drag zooms in (kept in the URL), a double-click (after uPlot's own handler) shows everything again
    const onSelect = (u) => {
      if (u.select.width < 2) return;
      const zoom = [u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x")];
      u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
      u.setScale("x", { min: zoom[0], max: zoom[1] });
      this.zoomCompare(zoom);
    };
    this.compareChart = makeChart(node, series, { x: $("#compare-x").value, log: this.compareLog,
      scales: { x: { time: false,
        range: (u, min, max) => this.compareZoom || (min < max ? [min, max] : [min - 1, max + 1]) } },
      cursor: { drag: { x: true, y: false, setScale: false } },
      hooks: { setCursor: [legendLast], setData: [legendLast], setSelect: [onSelect] } }, this.compareColumns());
    this.compareChart.over.addEventListener("dblclick", () => this.zoomCompare(null));
    node.setAttribute("data-series", String(runs.length));
    node.setAttribute("data-metric", key);
    showValues(this.compareValues, this.compareChart);
  }

  /* zoom the comparison to an x range ([min, max]), each run's rows there fetched at full resolution, or with
     null show everything again */
  async zoomCompare(zoom) {
    this.compareZoom = zoom;
    this.saveView();
    const runs = this.compareData, mode = $("#compare-x").value;
    if (!runs) return;
    for (const r of runs) r.detail = null;
    this.redrawCompare();
    if (!zoom) return;
    try {
      const details = await Promise.all(runs.map(({ id, run, metrics }) => {
        const [from, to] = stepRange(metrics.step, xValues(mode, metrics, run.config.model?.seq), zoom);
        return api(`/api/runs/${encodeURIComponent(id)}/metrics?from_step=${from}&to_step=${to}&max_points=${ZOOM_POINTS}`);
      }));
      if (this.compareZoom !== zoom || this.compareData !== runs) return;      // zoomed again meanwhile
      runs.forEach((r, i) => { r.detail = details[i]; });
      this.redrawCompare();
    } catch (e) {
      $("#compare-title").textContent = `zoom failed: ${e.message}`;
    }
  }

  /* the chart's data again (the smoothing changed, or rows arrived) */
  redrawCompare() {
    if (!this.compareChart) return;
    this.compareChart.setData(this.compareColumns());
    showValues(this.compareValues, this.compareChart);
  }

  /* the selected runs' metric over the chosen x axis (the union of their x values; each run null where
     it has no point), smoothed, and with the loss their validation losses as points */
  compareColumns() {
    const runs = this.compareData, node = $("#compare-chart");
    const { key, withVal } = this.compareMetric(), w = parseFloat($("#compare-smoothing").value) || 0;
    const mode = $("#compare-x").value;
    const cols = runs.map(({ run, metrics, detail }) => {
      const m = overlay(metrics, detail);        // (a zoomed range's rows at full resolution)
      return rowsWithX(xValues(mode, m, run.config.model?.seq), [smooth(m[key], w), m.val_loss]);
    });
    const xs = [...new Set(cols.flatMap((c) => c[0]))].sort((a, b) => a - b);
    const pos = new Map(xs.map((s, i) => [s, i]));
    const ys = cols.flatMap(([x, ...vals]) => vals.slice(0, withVal ? 2 : 1).map((v) => {
      const col = new Array(xs.length).fill(null);
      x.forEach((s, i) => { col[pos.get(s)] = v[i]; });
      return col;
    }));
    node.setAttribute("data-points", String(cols.reduce((n, c) => n + c[0].length, 0)));
    node.setAttribute("data-smoothing", String(w));
    return [xs, ...ys];
  }

  // -- a sweep's result: each compared run's validation loss against a setting in which they differ

  /* the settings: the config's numeric fields that differ between the runs (the run spec's first) */
  fillScatter() {
    const flats = this.compareData.map((r) => flatten(r.run.config));
    this.settings = flats;
    const fields = [...new Set(flats.flatMap(Object.keys))].filter((k) => flats.every((f) => Number.isFinite(f[k]))
      && flats.some((f) => f[k] !== flats[0][k])).sort((a, b) => Number(!a.startsWith("spec.")) - Number(!b.startsWith("spec.")) || (a < b ? -1 : 1));
    const sel = $("#scatter-x"), keep = sel.value || this.view.setting;
    sel.replaceChildren(...fields.map((f) => el("option", { value: f, text: f.replace(/^spec\./, "") })));
    if (fields.includes(keep)) sel.value = keep;
    if (this.view.value === "final") $("#scatter-y").value = "final";
    this.drawScatter();
  }

  /* one point per run: x its setting, y its best (or final) validation loss, in its colour */
  drawScatter() {
    const runs = this.compareData, node = $("#scatter-chart"), field = $("#scatter-x").value;
    if (this.scatterChart) { this.scatterChart.destroy(); this.scatterChart = null; }
    if (!runs || !field) {
      node.replaceChildren(el("p", { className: "empty", text: "The runs compared differ in no numeric setting." }));
      node.setAttribute("data-points", "0");
      return;
    }
    const final = $("#scatter-y").value === "final";
    const points = runs.map((r, i) => {
      const vals = r.metrics.val_loss.filter(Number.isFinite);
      return [this.settings[i][field], final ? vals.at(-1) : Math.min(...vals)];
    }).map(([x, y]) => [x, Number.isFinite(y) ? y : null]);
    const xs = [...new Set(points.filter((p) => p[1] !== null).map((p) => p[0]))].sort((a, b) => a - b);
    const log = xs[0] > 0 && xs.at(-1) / xs[0] >= 10;       // (a learning rate's grid spans decades)
    const name = field.replace(/^spec\./, "");
    this.scatterChart = makeChart(node, runs.map((r) => line(runLabel(r.id, r.run.meta), runColor(r.id),
      { spanGaps: false, points: { show: true, size: 9, fill: runColor(r.id) } })),
    { x: { label: name, fmt: (v) => fmt(v, 4), ticks: axisFmt },
      scales: { x: { time: false, ...(log ? { distr: 3, log: 10 } : {}),
        ...(xs.length === 1 ? { range: (u, min, max) => (log ? [min / 2, max * 2] : [min - 1, max + 1]) } : {}) } },
      cursor: { drag: { x: false, y: false } } },
    [xs, ...points.map(([x, y]) => xs.map((v) => (v === x ? y : null)))]);
    node.setAttribute("data-points", String(points.filter((p) => p[1] !== null).length));
  }

  // -- the compared runs' samples side by side, at a step chosen on a slider

  compareSampleSteps() {
    return [...new Set(this.compareData.flatMap((r) => [...r.samples.keys()]))].sort((a, b) => a - b);
  }

  /* each run's sample at the chosen step (its latest at or before it: runs sample at different steps) */
  renderCompareSamples() {
    const steps = this.compareSampleSteps(), slider = $("#compare-sample-step");
    slider.disabled = steps.length < 2;
    let i = steps.length - 1;
    if (this.compareSample !== null) i = Math.max(0, steps.findLastIndex((st) => st <= this.compareSample));
    const step = steps[i];
    slider.max = String(Math.max(0, steps.length - 1));
    slider.value = String(Math.max(0, i));
    const text = steps.length ? `step ${fmtInt(step)} (${i + 1} of ${steps.length})` : "no samples";
    slider.setAttribute("aria-valuetext", text);
    $("#compare-sample-value").textContent = text;
    $("#compare-samples").replaceChildren(...this.compareData.map((r) => {
      const at = [...r.samples.keys()].filter((st) => st <= step).sort((a, b) => a - b).at(-1);
      return el("div", { className: "sample", "data-run-id": r.id, "data-step": at ?? "" }, [
        el("span", { className: "meta" }, [swatch(r.id), runLabel(r.id, r.run.meta),
          at === undefined ? "" : ` · step ${fmtInt(at)}`]),
        el("div", { className: "text", text: at === undefined ? "no sample by this step" : r.samples.get(at) })]);
    }));
  }

  renderDiff(runs) {
    const table = $("#config-diff");
    const flats = runs.map((r) => flatten({ meta: r.run.meta, ...r.run.config }));
    const keys = [...new Set(flats.flatMap(Object.keys))]
      .sort((a, b) => fieldRank(a) - fieldRank(b) || (a < b ? -1 : a > b ? 1 : 0));
    $("thead", table).replaceChildren(el("tr", {}, [el("th", { text: "field" }),
      ...runs.map((r) => el("th", {}, [swatch(r.id), el("a", { href: runHref(r.id), text: runLabel(r.id, r.run.meta) })]))]));
    let ndiff = 0;
    $("tbody", table).replaceChildren(...keys.map((k) => {
      const vals = flats.map((f) => f[k]);
      const first = JSON.stringify(vals[0]);
      const differs = vals.some((v) => JSON.stringify(v) !== first);
      if (differs) ndiff++;
      return el("tr", { className: differs ? "diff" : null, "data-field": k },
        [el("th", { text: k }), ...vals.map((v) => el("td", { text: fmtValue(v) }))]);
    }));
    table.setAttribute("data-diff-count", String(ndiff));
  }
}
