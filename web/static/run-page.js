/* The run page: live charts (metrics over server-sent events), status, stop and resume, generation,
   samples, logs, the trainer process, checkpoints and the configuration. */

import { api, postEvents, runEvents } from "./api.js";
import { PALETTE, X_AXES, ZOOM_POINTS, appendRows, chartCsv, chartTools, condense, download, legendLast, line,
  makeChart, overlay, resizeAll, rowsWithX, setXMode, smooth, spacedDots, stepRange, tint, xMode, xValues }
  from "./charts.js";
import { chartValues, showValues } from "./chart-values.js";
import { $, debounce, el, setState } from "./dom.js";
import { flatten, fmt, fmtAgo, fmtBytes, fmtDate, fmtDuration, fmtInt, fmtValue } from "./format.js";
import { formatRange, parseRange, parseSmoothing, readView, writeView } from "./view.js";

const TIMING = [  // bottom of the stack first
  { key: "t_eval", label: "kernel eval", color: "#4e79a7" },
  { key: "t_io", label: "surface I/O", color: "#f28e2b" },
  { key: "t_cpu", label: "CPU ops", color: "#59a14f" },
  { key: "t_cls", label: "classifier", color: "#e15759" },
  { key: "t_dw_wait", label: "dW wait", color: "#76b7b2" },
];
const TERMINAL = ["finished", "stopped", "failed", "cancelled"];
const CONFIG_GROUPS = { spec: "Run spec", model: "Model" };

/* the mean of the finite values among the last 20 */
function recentMean(a) {
  const vals = a.slice(-20).filter(Number.isFinite);
  return vals.length ? vals.reduce((s, v) => s + v, 0) / vals.length : null;
}

export class RunPage {
  constructor(runId) {
    this.id = runId;
    this.base = `/api/runs/${encodeURIComponent(runId)}`;
    this.m = { step: [] };       // the metrics the run records (the columns of its /metrics answer), as drawn
    const view = readView();     // a link's or a reload's view: x axis, smoothing, zoom, log scales
    this.smoothing = parseSmoothing(view.smooth, parseFloat($("#smoothing").value));
    this.logs = new Set((view.log || "").split(",").filter(Boolean));
    this.state = null;
    this.status = {};
    this.checkpoints = [];
    this.samples = new Map();    // step -> text
    this.sampleStep = Number.isInteger(Number(view.sample)) && view.sample ? Number(view.sample) : null;  // null: the latest
    this.es = null;
    this.drawPending = false;
    this.logsTimer = null;
    this.logsDue = 0;
    this.systemBusy = false;
    this.deleting = false;       // a delete sent: the page polls nothing more
    this.zoom = parseRange(view.zoom);   // [min, max] x of a drag selection: kept over live updates
    this.detail = null;          // the zoomed range's metrics at full resolution (the server's columns)
    this.x = X_AXES[view.x] ? view.x : xMode();    // the x axis: step, tokens or time
    this.seq = null;             // tokens per micro-step (the model's seq), for the tokens axis
    this.stopRequested = false;  // a stop sent from this page, until the run reaches a terminal state
  }

  start() {
    // the requests first (a large run's first read takes the server a while), the charts made meanwhile
    const metrics = this.loadMetrics();
    this.loadRun();
    this.loadCheckpoints();
    this.loadSamples();
    $("#sample-step").addEventListener("input", (ev) => {
      const steps = this.sampleSteps(), i = Number(ev.target.value);
      this.sampleStep = i < steps.length - 1 ? steps[i] : null;     // at the right end it follows new samples
      this.renderSamples();
      this.saveView();
    });
    this.loadLogs();
    this.pollSystem();
    this.initCharts();
    this.bindCollapse();
    this.bindControls();
    this.bindExport();
    this.bindMeta();
    setInterval(() => { this.pollSystem(); this.renderTimes(); }, 2000);
    setInterval(() => { if (this.isRunning()) this.loadCheckpoints(); }, 5000);
    metrics.then(() => {
      this.connect();
      if (this.zoom) this.setZoom(this.zoom);     // (a link's zoom: its rows at full resolution)
    });
    window.addEventListener("resize", debounce(() => resizeAll(this.charts), 150));
  }

  isRunning() { return this.state === "running" || this.state === "restarting"; }

  message(text, kind) {
    const m = $("#run-message");     // (a failed run's error ends with its last log lines, one a line)
    m.replaceChildren(...(text || "").split("\n").flatMap((line, i) => (i ? [el("br"), line] : [line])));
    m.hidden = !text;
    m.className = "message banner" + (kind ? ` ${kind}` : "");
  }

  // -- charts

  /* every chart shares one x range: the zoom when one was selected, else all of the x drawn */
  xRange() {
    if (this.zoom) return this.zoom;
    const xs = (this.xAll || []).filter(Number.isFinite);
    if (!xs.length) return [0, 1];
    const lo = xs[0], hi = xs[xs.length - 1];
    return lo === hi ? [lo - 1, hi + 1] : [lo, hi];
  }

  /* zoom (a [min, max] selection) or, with null, show everything again, on every chart; the range's rows
     are then fetched at full resolution (the first load has a long run's down-sampled); preset: the zoom
     button it comes from (data-zoom), shown pressed */
  async setZoom(zoom, preset = zoom ? null : "1") {
    this.zoom = zoom;
    this.detail = null;
    this.saveView();
    for (const b of document.querySelectorAll("#zoom button")) b.setAttribute("aria-pressed", String(b.dataset.zoom === preset));
    const [min, max] = this.xRange();
    for (const c of this.charts) c.plot.setScale("x", { min, max });
    if (!zoom) { this.draw(); return; }
    const [from, to] = stepRange(this.m.step, xValues(this.x, this.m, this.seq), zoom);
    try {
      const detail = await api(`${this.base}/metrics?from_step=${from}&to_step=${to}&max_points=${ZOOM_POINTS}`);
      if (this.zoom !== zoom) return;            // zoomed again meanwhile
      this.detail = detail;
      this.draw();
    } catch (e) {
      this.message(`Could not load the zoomed range: ${e.message}`, "error");
    }
  }

  /* the view in the URL */
  saveView() {
    writeView({ x: this.x, smooth: this.smoothing, zoom: formatRange(this.zoom),
      log: this.charts.filter((c) => c.log).map((c) => c.key).join(","), sample: this.sampleStep });
  }

  /* the charts: their series and the columns they draw (cols(m): one per series) */
  chartDefs() {
    const lrValue = (u, v) => (v === null || v === undefined ? "–" : v.toExponential(2));
    const one = (key, label, color, more = {}) => ({ key, series: [line(label, color)], ...more });
    return [
      { key: "loss", log: this.logs.has("loss"), series: [
        line("raw", "rgba(31,111,178,0.28)", { width: 1 }),
        line("smoothed", "#1f6fb2", { width: 2 }),
        line("validation", "#d9480f",
          { width: 2, points: { show: true, size: 5, fill: "#d9480f", filter: spacedDots(8) } }),
      ], cols: (m) => [m.loss, smooth(m.loss, this.smoothing), m.val_loss] },
      { key: "lr", series: [line("lr", "#7048e8", { value: lrValue })], cols: (m) => [m.lr] },
      { key: "grad-norm", log: this.logs.has("grad-norm"), sparse: true, cols: (m) => [m.grad_norm],
        series: [line("grad norm", "#c92a2a", { points: { show: true, size: 3, fill: "#c92a2a" } })] },
      one("loss-scale", "loss scale", "#8c564b", { cols: (m) => [m.loss_scale] }),
      { key: "ms", ...this.stepTimes([]) },
      one("tps", "tokens/s", "#e67700", { cols: (m) => [m.tokens_per_s] }),
      // stacked area: the cumulative top is drawn first, each lower band paints over it; the tooltip,
      // legend and CSV give each component's own time (raw)
      { key: "timing", scales: { y: { range: (u, min, max) => [0, max > 0 ? max * 1.05 : 1] } },
        series: TIMING.slice().reverse().map((t, k) => ({
          label: t.label, stroke: t.color, width: 1, fill: tint(t.color, 0.35), points: { show: false },
          fillTo: () => 0, value: (u, v, si, i) => `${fmt(this.timingRaw?.[k]?.[i], 3)} ms`,
        })),
        cols: (m) => {
          const cum = [];
          TIMING.forEach((t, k) => cum.push(m[t.key].map((v, j) => (k ? cum[k - 1][j] : 0) + (Number.isFinite(v) ? v : 0))));
          return [...cum.reverse(), ...TIMING.slice().reverse().map((t) => m[t.key])];
        } },
      // the trainer's CPU % and the kernels' share of the step (on a Mac: the ANE's), at the log steps
      { key: "cpu", sparse: true, series: [line("CPU %", "#0b7285"), line("kernel eval % of step", "#4e79a7")],
        cols: (m) => [m.cpu_pct, m.t_eval.map((t, i) => (Number.isFinite(t) && m.ms_step[i] > 0 ? 100 * t / m.ms_step[i] : null))] },
      one("rss", "RSS MB", "#862e9c", { sparse: true, cols: (m) => [m.rss_mb] }),
    ];
  }

  /* the ms/step chart's series and columns: one, or on several MPI ranks one per rank (a row's step time is
     that of the rank that ran it) */
  stepTimes(ranks) {
    if (ranks.length < 2) return { ranks, series: [line("ms/step", "#2b8a3e")], cols: (m) => [m.ms_step] };
    return { ranks, series: ranks.map((r, k) => line(`rank ${r}`, PALETTE[k % PALETTE.length])),
      cols: (m) => ranks.map((r) => m.ms_step.map((v, i) => (m.rank[i] === r ? v : null))) };
  }

  initCharts() {
    this.charts = this.chartDefs();
    this.cLoss = this.charts[0];
    this.cMs = this.charts.find((c) => c.key === "ms");
    for (const c of this.charts) {
      c.node = document.getElementById(`chart-${c.key}`);
      const head = c.node.parentNode.querySelector(".card-head"), title = $("h2", head).textContent;
      const toggleLog = c.log === undefined ? null : (on) => { c.log = on; this.build(c); this.draw(); this.saveView(); };
      chartTools(head, title, { log: c.log, onLog: toggleLog,
        csv: () => download(`${this.id}-${c.key}.csv`, chartCsv(c.plot, c.key === "timing" ? this.timingRaw : undefined)),
        picture: () => ({ plot: c.plot, name: `${this.id}-${c.key}`, title: `${this.id}: ${title}`,
          y: $(".hint", head)?.textContent || title }) });
      c.values = chartValues(c.node, title);
      c.values.addEventListener("toggle", () => this.showValues(c));
    }
    this.buildAll();
  }

  /* each card's heading a button that folds the card to it; on a phone every card but the loss's starts
     folded (the page was 6,490 px tall at 390 px) */
  bindCollapse() {
    const phone = matchMedia("(max-width: 480px)").matches;
    for (const card of document.querySelectorAll("main .card")) {
      const h2 = $(".card-head h2", card);
      const b = el("button", { type: "button", className: "collapse" }, [...h2.childNodes]);
      h2.replaceChildren(b);
      const open = (yes) => {
        b.setAttribute("aria-expanded", String(yes));
        card.classList.toggle("collapsed", !yes);
        if (!yes) return;
        resizeAll(this.charts.filter((c) => card.contains(c.node)));   // (drawn while hidden)
        if (card.contains($("#logs")) && $("#logs-follow").checked) $("#logs").scrollTop = $("#logs").scrollHeight;
      };
      b.addEventListener("click", () => open(card.classList.contains("collapsed")));
      open(!phone || card.contains(this.cLoss.node));
    }
  }

  buildAll() {
    for (const c of this.charts) this.build(c);
    this.draw();
  }

  /* (re)make a chart: the x mode, its log scale, the theme's colours are fixed when it is made */
  build(c) {
    // a drag selects a range: setZoom applies it to all charts (uPlot's own setScale would be undone by
    // xRange); a double-click (after uPlot's own handler) shows everything again
    const onSelect = (u) => {
      if (u.select.width < 2) return;
      const zoom = [u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x")];
      u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
      this.setZoom(zoom);
    };
    c.plot?.destroy();
    c.plot = makeChart(c.node, c.series, { x: this.x, log: c.log, y: c.y,
      scales: { x: { time: false, range: () => this.xRange() }, ...c.scales },
      cursor: { sync: { key: `run-${this.id}`, setSeries: false }, drag: { x: true, y: false, setScale: false } },
      hooks: { setCursor: [legendLast], setData: [legendLast], setSelect: [onSelect] } });
    c.node.setAttribute("data-log", String(!!c.log));
    c.node.append(el("p", { className: "chart-empty", hidden: true }));
    c.plot.over.addEventListener("dblclick", () => this.setZoom(null));
  }

  /* live rows: drawn at most every 250 ms, one chart per task (a long run's nine charts in one task
     would hold up the page) */
  scheduleDraw() {
    this.dirty = true;
    if (this.drawPending) return;
    this.drawPending = true;
    setTimeout(async () => {
      while (this.dirty) {
        this.dirty = false;
        await this.draw(true);
      }
      this.drawPending = false;
    }, 250);
  }

  /* every chart from the metrics (at once, or with `stagger` one per task; this.m may change between
     them, so the columns are taken first) */
  async draw(stagger = false) {
    if (!this.m.loss) return;  // the metrics are not loaded yet
    const m = overlay({ ...this.m }, this.detail);
    const xAll = this.xAll = xValues(this.x, m, this.seq);
    const ranks = [...new Set(m.rank.filter(Number.isFinite))].sort((a, b) => a - b);
    if (String(ranks) !== String(this.cMs.ranks)) {  // (a run's first rows, or its first of another rank)
      Object.assign(this.cMs, this.stepTimes(ranks));
      this.build(this.cMs);
    }
    for (const c of this.charts) {
      const data = rowsWithX(xAll, c.cols(m), c.sparse);
      if (c.key === "timing") this.timingRaw = data.splice(1 + TIMING.length);
      c.plot.setData(data);
      c.node.setAttribute("data-points", String(data[0].length));
      this.showEmpty(c, !data[0].length);
      this.showValues(c);
      if (c === this.cLoss) this.lossDrawn();
      if (stagger) await new Promise((resolve) => setTimeout(resolve));
    }
  }

  /* a chart with nothing to draw says why, over its empty axes */
  showEmpty(c, empty) {
    const note = $(".chart-empty", c.node);
    note.hidden = !empty;
    c.node.toggleAttribute("data-empty", empty);
    if (!empty) return;
    note.textContent = this.state === "queued" ? "No steps yet: the run is queued."
      : TERMINAL.includes(this.state)
        ? (this.m.step.length ? "No values of this metric were recorded." : "No steps were recorded.")
        : this.m.step.length ? "No values of this metric yet." : "No steps yet.";
  }

  /* a chart's values table, when it is open (the step timing's: each component's own time) */
  showValues(c) {
    showValues(c.values, c.plot, c.key === "timing" ? this.timingRaw : undefined);
  }

  lossDrawn() {
    const node = this.cLoss.node, [, raw, sm, val] = this.cLoss.plot.data;
    node.setAttribute("data-val-points", String(val.filter((v) => v !== null).length));
    node.setAttribute("data-smoothing", String(this.smoothing));
    const i = sm.findLastIndex((v) => v !== null);
    if (i >= 0) {
      node.setAttribute("data-last-smoothed", String(sm[i]));
      node.setAttribute("data-last-raw", String(raw[i]));
    }
    $("#stat-smoothed").textContent = fmt(sm[i], 4);
    this.renderTimes();
  }

  /* the run's header: its first row's time, the time since (to its last row once it has ended), and
     while it runs the time its remaining steps take at the pace of its last 50 rows */
  renderTimes() {
    const { step, t } = this.m, rows = (t || []).flatMap((v, i) => (Number.isFinite(v) ? [[step[i], v]] : []));
    if (!rows.length) return;
    const [, t0] = rows[0], [s1, t1] = rows.at(-1), [s0, tp] = rows.at(-Math.min(rows.length, 50));
    const running = this.isRunning(), steps = this.status.steps, started = $("#stat-started");
    started.dateTime = new Date(t0 * 1000).toISOString();
    started.textContent = fmtDate(t0);
    $("#stat-elapsed").textContent = fmtDuration((running ? Date.now() / 1000 : t1) - t0);
    const eta = running && steps && s1 > s0 ? Math.max(0, steps - s1) * (t1 - tp) / (s1 - s0) : null;
    $("#stat-eta").textContent = fmtDuration(eta);
  }

  // -- controls

  bindControls() {
    const xSelect = $("#x-axis");
    xSelect.value = this.x;
    xSelect.addEventListener("change", () => {
      this.x = xSelect.value;
      setXMode(this.x);
      this.setZoom(null);
      this.buildAll();
      this.saveView();
    });
    document.addEventListener("themechange", () => this.buildAll());
    for (const b of document.querySelectorAll("#zoom button")) {
      b.addEventListener("click", () => {       // the last fraction of all the x drawn
        this.zoom = null;
        const f = parseFloat(b.dataset.zoom), [lo, hi] = this.xRange();
        this.setZoom(f < 1 ? [hi - f * (hi - lo), hi] : null, b.dataset.zoom);
      });
    }
    const slider = $("#smoothing");
    const showSmoothing = () => { $("#smoothing-value").textContent = this.smoothing.toFixed(3); };
    slider.value = String(this.smoothing);
    showSmoothing();
    const onSlide = () => {
      this.smoothing = parseSmoothing(slider.value, 0);
      showSmoothing();
      this.draw();
      this.saveView();
    };
    slider.addEventListener("input", onSlide);
    slider.addEventListener("change", onSlide);

    $("#stop-btn").addEventListener("click", async (ev) => {
      if (ev.currentTarget === document.activeElement) $("#state").focus();   // (not lost with the disabled button)
      ev.currentTarget.disabled = true;
      this.stopRequested = true;
      setState($("#state"), "stopping");
      try {
        await api(`${this.base}/stop`, "POST");
        // (the run may have ended already: setStatus then cleared stopRequested)
        if (this.stopRequested) this.message("Stop requested: the trainer checkpoints and exits.", "info");
      } catch (e) {
        this.stopRequested = false;
        this.message(`Stop failed: ${e.message}`, "error");
        this.loadRun();
      }
    });
    $("#resume-btn").addEventListener("click", async (ev) => {
      if (ev.currentTarget === document.activeElement) $("#state").focus();   // (not lost with the disabled button)
      ev.currentTarget.disabled = true;
      const requeue = this.state === "cancelled";
      try {
        await api(`${this.base}/resume`, "POST");
        if (requeue) await this.loadRun();   // queued (or started at once)
        else {
          this.message("Resumed from the latest checkpoint.", "info");
          this.setStatus({ state: "running" });
        }
        this.reconnect();
      } catch (e) {
        this.message(`Resume failed: ${e.message}`, "error");
        this.loadRun();
      }
    });

    $("#generate-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const btn = $("#generate-btn"), out = $("#generate-output");
      const number = (sel, parse) => { const v = parse($(sel).value); return isFinite(v) ? v : undefined; };
      const body = {  // (a field that is not a number is left out: the server's default)
        prompt: $("#generate-prompt").value,
        temperature: number("#generate-temperature", parseFloat),
        top_k: number("#generate-topk", (s) => parseInt(s, 10)),
        top_p: number("#generate-topp", parseFloat),
        max_tokens: number("#generate-tokens", (s) => parseInt(s, 10)),
        checkpoint: $("#generate-checkpoint").value,
      };
      btn.disabled = true;
      const meta = el("span", { className: "meta", text: "generating…" }), text = el("div", { className: "text" });
      out.className = "generated pending";
      out.removeAttribute("data-step");
      out.replaceChildren(meta, text);
      try {     // the text grows as the tokens arrive
        await postEvents(`${this.base}/generate/stream`, body, (name, data) => {
          if (name === "error") throw new Error(data.detail);
          if (name === "token") text.append(data.text);
          if (name === "done") {
            meta.textContent = `checkpoint at step ${fmtInt(data.step)}, ${fmtInt(data.n_generated)} tokens, ` +
              `${fmtInt(Math.round(data.tokens_per_s))} tok/s`;
            out.className = "generated";
            out.setAttribute("data-step", String(data.step));
          }
        });
      } catch (e) {
        out.className = "generated error";
        out.textContent = `Generation failed: ${e.message}`;
      }
      btn.disabled = false;
    });
  }

  /* name, tags and notes (PATCH the run), archive, delete (after a confirmation) */
  bindMeta() {
    const msg = $("#meta-message");
    const say = (text, kind = "") => { msg.textContent = text; msg.className = `message ${kind}`; };
    const patch = async (change, done) => {
      try {
        this.showMeta(await api(this.base, "PATCH", change));
        say(done, "info");
      } catch (e) { say(e.message, "error"); }
    };
    $("#meta-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      patch({ name: $("#meta-name").value.trim(), tags: $("#meta-tags").value.split(/[\s,]+/).filter(Boolean),
        notes: $("#meta-notes").value }, "saved");
    });
    $("#archive-btn").addEventListener("click", () => {
      const archive = !this.meta?.archived;
      patch({ archived: archive }, archive ? "archived: hidden from the runs list" : "back in the runs list");
    });
    $("#delete-btn").addEventListener("click", async () => {
      if (!window.confirm(`Delete run ${this.id} and all its files (checkpoints included)?`)) return;
      this.deleting = true;    // no more polls of a run that is going (they would get 404s)
      try {
        await api(this.base, "DELETE");
        window.location.href = "/";
      } catch (e) {
        this.deleting = false;
        say(`Delete failed: ${e.message}`, "error");
      }
    });
  }

  showMeta(meta) {
    this.meta = meta;
    $("#meta-name").value = meta.name;
    $("#meta-tags").value = meta.tags.join(" ");
    $("#meta-notes").value = meta.notes;
    $("#archive-btn").textContent = meta.archived ? "Unarchive" : "Archive";
    $("#archive-btn").setAttribute("aria-pressed", String(meta.archived));
    $("#run-id").textContent = meta.name || this.id;
    for (const c of $("#meta-form").querySelectorAll("[disabled]")) c.disabled = false;   // (see run.html)
  }

  /* the Export form: POST .../export, then the answer (a zip or a .gguf file) saved as a download */
  bindExport() {
    $("#export-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const btn = $("#export-btn"), status = $("#export-status");
      const body = { format: $("#export-format").value, dtype: $("#export-dtype").value };
      if ($("#export-checkpoint").value) body.checkpoint = $("#export-checkpoint").value;
      btn.disabled = true;
      status.className = "hint";
      status.textContent = "exporting…";
      try {
        const r = await fetch(`${this.base}/export`, { method: "POST", headers: { "Content-Type": "application/json" },
                                                       body: JSON.stringify(body) });
        if (!r.ok) throw new Error((await r.json().catch(() => null))?.detail || `HTTP ${r.status}`);
        const name = /filename="([^"]+)"/.exec(r.headers.get("Content-Disposition") || "")?.[1] || "export";
        const blob = await r.blob();
        download(name, blob);
        status.textContent = `${name}, ${fmtBytes(blob.size)}`;
        status.setAttribute("data-file", name);
      } catch (e) {
        status.className = "hint error";
        status.textContent = `Export failed: ${e.message}`;
      }
      btn.disabled = false;
    });
  }

  // -- the run: status, summary, config

  async loadRun() {
    try {
      const r = await api(this.base);
      this.setStatus(r.status);
      this.renderConfig(r.config);
      this.renderSummary(r.summary);
      if (!this.meta) this.showMeta(r.meta);
      const c = r.config, spec = c.spec || {};  // (before the trainer wrote config.json: the launched spec)
      if (c.model?.seq && c.model.seq !== this.seq) {
        this.seq = c.model.seq;
        this.draw();
      }
      // with LoRA, the parameters trained and those frozen
      const params = !c.params ? null : c.trainable && c.trainable < c.params
        ? `${fmt(c.trainable / 1e6, 3)}M trainable, ${fmt((c.params - c.trainable) / 1e6, 3)}M frozen`
        : `${fmt(c.params / 1e6, 3)}M params`;
      $("#run-subtitle").textContent = [this.meta?.name && this.id, c.model_name || spec.model, params,
        c.device || spec.backend, spec.precision]
        .filter(Boolean).join(" · ");
    } catch (e) {
      this.message(`Could not load the run: ${e.message}`, "error");
    }
  }

  /* a status (status.json as the server corrects it), or a part of one */
  setStatus(st) {
    const prev = this.state;
    this.state = st.state || this.state;
    this.status = { ...this.status, ...st };
    const running = this.isRunning();
    if (this.stopRequested && TERMINAL.includes(this.state)) {
      this.stopRequested = false;
      this.message("");
    }
    setState($("#state"), this.stopRequested && running ? "stopping" : this.state);
    this.showLive();
    if (prev !== this.state) this.draw();          // (an empty chart's note names the state)
    const queued = this.state === "queued";
    $("#stop-btn").disabled = !(running || queued) || this.stopRequested;
    $("#stop-btn").textContent = queued ? "Cancel" : "Stop";
    if (queued) this.message(`Queued, #${this.status.position}: it starts when a running run ends.`, "info");
    else if (prev === "queued") this.message("");
    const hasCkpt = this.checkpoints.some((c) => c.name === "latest.ckpt"), cancelled = this.state === "cancelled";
    $("#resume-btn").disabled = running || queued || !(hasCkpt || cancelled) || this.state === "finished";
    $("#resume-btn").textContent = cancelled ? "Queue again" : "Resume";
    $("#delete-btn").disabled = running;   // (the server refuses it: stop the run first)
    // a notice of what was done (resumed, stopping) ends with the run
    if (prev && prev !== this.state && TERMINAL.includes(this.state) && $("#run-message").classList.contains("info")) {
      this.message("");
    }
    if (this.state === "failed" && st.error) this.message(`Run failed: ${st.error}`, "error");
    // the step: the status's, or the last row drawn when that is later (status.json is written less often)
    const s = this.status, step = Math.max(s.step ?? -1, this.m.step.at(-1) ?? -1);
    if (step >= 0 && s.steps) {
      $("#stat-step").textContent = `${fmtInt(step)} / ${fmtInt(s.steps)}`;
      $("#progress").max = s.steps;
      $("#progress").value = Math.min(step, s.steps);
    }
    // the trainer's live figures (status.json): the latest loss and the best validation loss so far
    if (st.loss !== undefined) $("#stat-loss").textContent = fmt(st.loss, 4);
    if (st.best_val_loss !== undefined) $("#stat-best").textContent = fmt(st.best_val_loss, 4);
    if (prev && prev !== this.state && TERMINAL.includes(this.state)) {
      this.loadCheckpoints();
      this.loadRun();
    }
  }

  /* the run's summary, or the figures of it given */
  renderSummary(s) {
    if (s.last_loss !== undefined) $("#stat-loss").textContent = fmt(s.last_loss, 4);
    if (s.best_val_loss !== undefined) $("#stat-best").textContent = fmt(s.best_val_loss, 4);
    if (s.tokens_per_s !== undefined) $("#stat-tps").textContent = fmtInt(s.tokens_per_s);
    if (s.ms_step !== undefined) $("#stat-ms").textContent = fmt(s.ms_step, 3);
  }

  /* one definition list per part of config.json: the run spec, the model, then the other fields;
     each value carries its flattened name (as in the compare view) in data-field */
  renderConfig(cfg) {
    const flat = flatten(cfg), groups = {};
    for (const k of Object.keys(flat)) {
      const dot = k.indexOf("."), group = dot > 0 ? k.slice(0, dot) : "";
      (groups[group] ||= []).push(k);
    }
    const order = [...Object.keys(CONFIG_GROUPS), ...Object.keys(groups).filter((g) => !CONFIG_GROUPS[g])];
    $("#config").replaceChildren(...order.filter((g) => groups[g]).map((g) => {
      const dl = el("dl", { className: "kv" }, groups[g].flatMap((k) => [
        el("dt", { text: g ? k.slice(g.length + 1) : k }),
        el("dd", { "data-field": k, text: fmtValue(flat[k]) }),
      ]));
      return el("section", { className: "config-group" }, [el("h3", { text: CONFIG_GROUPS[g] || g || "Run" }), dl]);
    }));
  }

  // -- metrics

  async loadMetrics() {
    try {
      this.m = await api($("#metrics-first").getAttribute("href"));
      this.draw();
      this.setStatus({});
    } catch (e) {
      this.message(`Could not load metrics: ${e.message}`, "error");
    }
  }

  /* rows of a metrics event: {step, each metric} */
  addRows(rows) {
    const m = this.m;
    appendRows(m, rows);
    condense(m, () => api($("#metrics-first").getAttribute("href"))).then((done) => done && this.scheduleDraw(),
      () => {});    // (kept as it is until the next rows)
    const last = rows[rows.length - 1];
    if (last) {
      this.renderSummary({ last_loss: last.loss, tokens_per_s: recentMean(m.tokens_per_s),
        ms_step: recentMean(m.ms_step) });
      this.setStatus({});      // the step tile: step S, S micro-steps done
    }
    this.scheduleDraw();
  }

  // -- the live stream

  /* the live badge: green only while the stream is open and the run is running */
  showLive() {
    const open = this.isRunning() ? ["on", "live"] : ["wait", this.state === "queued" ? "queued" : "waiting"];
    const [on, text] = { open, ended: ["off", "ended"], reconnecting: ["wait", "reconnecting"] }[this.stream]
      || ["off", "offline"];
    $("#live").setAttribute("data-live", on);
    $("#live").textContent = text;
  }

  connect() {
    const setLive = (stream) => { this.stream = stream; this.showLive(); };
    // replay from the last step already drawn, so nothing written since the initial load is lost
    const es = this.es = runEvents(this.id, this.m.step.at(-1) ?? -1, {
      open: () => setLive("open"),
      metrics: (d) => this.addRows(d.rows),
      log: () => this.scheduleLogs(),
      sample: (s) => this.addSample(s),
      status: (st) => this.setStatus(st),
      done: () => {
        if (this.es === es) this.es = null;
        setLive("ended");
        this.loadRun();
        this.loadCheckpoints();
        this.scheduleLogs();
      },
      error: () => {
        setLive(es.readyState === EventSource.CLOSED ? "offline" : "reconnecting");
      },
    });
  }

  reconnect() {
    if (this.es) { this.es.close(); this.es = null; }
    // give the new trainer a moment to truncate metrics past its checkpoint, then reload
    setTimeout(() => this.loadMetrics().then(() => this.connect()), 800);
  }

  // -- logs, samples, system, checkpoints

  scheduleLogs() {
    if (this.logsTimer) return;
    this.logsTimer = setTimeout(() => {
      this.logsTimer = null;
      this.logsDue = Date.now() + 1000;
      this.loadLogs();
    }, Math.max(0, this.logsDue - Date.now()));
  }

  async loadLogs() {
    const pre = $("#logs");
    try {
      const { lines } = await api(`${this.base}/logs?tail=300`);
      const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 24;
      pre.textContent = lines.length ? lines.join("\n") : "(no output yet)";
      pre.setAttribute("data-lines", String(lines.length));
      if ($("#logs-follow").checked || atBottom) pre.scrollTop = pre.scrollHeight;
    } catch { /* shown again on the next log event */ }
  }

  async loadSamples() {
    try {
      const { samples } = await api(`${this.base}/samples`);
      for (const s of samples) this.addSample(s, true);
      this.renderSamples();
    } catch { /* the samples panel keeps what it shows */ }
  }

  addSample(s, noRender) {
    this.samples.set(s.step, s.text);
    if (!noRender) this.renderSamples();
  }

  sampleSteps() {
    return [...this.samples.keys()].sort((a, b) => a - b);
  }

  /* the sample of the step chosen on the slider (the latest sample until one is chosen) */
  renderSamples() {
    const box = $("#samples"), slider = $("#sample-step"), steps = this.sampleSteps();
    box.setAttribute("data-count", String(steps.length));
    slider.disabled = steps.length < 2;
    if (!steps.length) { box.replaceChildren(el("p", { className: "empty", text: "No samples yet." })); return; }
    let i = steps.length - 1;
    if (this.sampleStep !== null) i = Math.max(0, steps.findLastIndex((st) => st <= this.sampleStep));
    slider.max = String(steps.length - 1);
    slider.value = String(i);
    const text = `step ${fmtInt(steps[i])} (${i + 1} of ${steps.length})`;
    slider.setAttribute("aria-valuetext", text);
    $("#sample-step-value").textContent = text;
    box.replaceChildren(el("div", { className: "sample", "data-step": steps[i] }, [
      el("div", { className: "text", text: this.samples.get(steps[i]) })]));
  }

  async pollSystem() {
    if (this.systemBusy || this.deleting) return;
    this.systemBusy = true;
    const box = $("#system");
    try {
      const s = await api(`${this.base}/system`);
      const set = (field, text) => { $(`[data-field="${field}"]`, box).textContent = text; };
      set("pid", s.pid === null ? "–" : String(s.pid));
      set("alive", s.alive ? "yes" : "no");
      set("cpu_percent", s.cpu_percent === null ? "–" : `${s.cpu_percent.toFixed(1)} %`);
      set("rss_mb", s.rss_mb === null ? "–" : `${s.rss_mb.toFixed(1)} MB`);
      box.setAttribute("data-alive", s.alive ? "true" : "false");
      box.setAttribute("data-updated", String(Date.now()));
    } catch { /* polled again in 2 s */ }
    this.systemBusy = false;
  }

  async loadCheckpoints() {
    const list = $("#checkpoints");
    try {
      const { checkpoints } = await api(`${this.base}/checkpoints`);
      this.checkpoints = checkpoints;
      list.setAttribute("data-count", String(checkpoints.length));
      list.replaceChildren(...checkpoints.map((c) => el("li", {}, [
        el("a", { className: "checkpoint-link", href: `${this.base}/checkpoints/${encodeURIComponent(c.name)}`,
          download: "", text: c.name }),  // "": saved under the server's name, RUN-latest-stepN.ckpt
        el("span", { className: "meta", text: [c.step == null ? null : `step ${fmtInt(c.step)}`,
          c.best_val_loss == null ? null : `best val ${c.best_val_loss.toFixed(4)}`,
          fmtBytes(c.bytes), fmtAgo(c.modified)].filter(Boolean).join(" · ") }),
        el("code", { className: "sha", title: `sha256 ${c.sha256}`, text: c.sha256.slice(0, 12) }),
      ])));
      if (!checkpoints.length) list.append(el("li", { className: "empty", text: "No checkpoints yet." }));
      this.setStatus({});
    } catch { /* listed again on the next poll */ }
  }
}
