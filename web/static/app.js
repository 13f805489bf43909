/* anectypes dashboard: the runs list, the start form, run comparison and the live run page.
 * Vanilla JS, no build step, no external requests. Charts use the vendored uPlot (global `uPlot`).
 * The page is served with CSP default-src 'self': no inline scripts or style attributes, so styles
 * are set through classes or the CSSOM (element.style), never through markup.
 */
(function () {
  "use strict";

  // ---------------------------------------------------------------- helpers

  var METRIC_KEYS = ["step"];  // the metrics a run records: the columns of its first /metrics answer
  var TIMING = [  // bottom of the stack first
    { key: "t_eval", label: "kernel eval", color: "#4e79a7" },
    { key: "t_io", label: "surface I/O", color: "#f28e2b" },
    { key: "t_cpu", label: "CPU ops", color: "#59a14f" },
    { key: "t_cls", label: "classifier", color: "#e15759" },
    { key: "t_dw_wait", label: "dW wait", color: "#76b7b2" }
  ];
  var PALETTE = ["#1f6fb2", "#d9480f", "#2b8a3e", "#9c36b5", "#c92a2a", "#0b7285", "#e67700",
    "#5c940d", "#862e9c", "#495057"];
  var TERMINAL = { finished: 1, stopped: 1, failed: 1 };
  var MAX_POINTS = 6000;  // client-side cap per run; older points are thinned by 2 beyond it

  function $(sel, root) { return (root || document).querySelector(sel); }
  function $all(sel, root) { return Array.prototype.slice.call((root || document).querySelectorAll(sel)); }

  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) {
        var v = attrs[k];
        if (v === null || v === undefined || v === false) return;
        if (k === "text") e.textContent = v;
        else if (k === "className") e.className = v;
        else e.setAttribute(k, v === true ? "" : String(v));
      });
    }
    (children || []).forEach(function (c) {
      if (c === null || c === undefined) return;
      e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return e;
  }

  function ApiError(status, message) { this.status = status; this.message = message; }

  function detailMessage(body, status) {
    if (!body) return "HTTP " + status;
    var d = body.detail;
    if (typeof d === "string") return d;
    if (Array.isArray(d)) {
      return d.map(function (e) {
        var loc = (e.loc || []).filter(function (p) { return p !== "body"; }).join(".");
        return (loc ? loc + ": " : "") + (e.msg || JSON.stringify(e));
      }).join("; ");
    }
    if (d) return JSON.stringify(d);
    return body.error || body.message || "HTTP " + status;
  }

  /* fetch JSON; POST bodies are always JSON (the server refuses anything else). */
  function api(path, method, body) {
    var opts = { method: method || "GET", headers: { "Accept": "application/json" }, credentials: "same-origin" };
    if (opts.method !== "GET") {
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body === undefined ? {} : body);
    }
    return fetch(path, opts).then(function (r) {
      return r.text().then(function (text) {
        var data = null;
        try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
        if (!r.ok) throw new ApiError(r.status, detailMessage(data, r.status));
        return data;
      });
    });
  }

  function errText(e) { return e instanceof ApiError ? e.message : (e && e.message) || String(e); }

  function fmt(v, digits) {
    if (v === null || v === undefined || v === "" || (typeof v === "number" && !isFinite(v))) return "–";
    if (typeof v !== "number") return String(v);
    var a = Math.abs(v);
    if (v === 0) return "0";
    if (a >= 1e6 || a < 1e-3) return v.toExponential(digits === undefined ? 2 : Math.max(1, digits - 1));
    if (Number.isInteger(v)) return String(v);
    return String(parseFloat(v.toPrecision(digits || 4)));
  }

  function fmtInt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    return Math.round(v).toLocaleString("en-US");
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    var u = ["B", "KB", "MB", "GB"], i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + u[i];
  }

  function toDate(v) {
    if (v === null || v === undefined || v === "") return null;
    if (typeof v === "number") return new Date(v > 1e12 ? v : v * 1000);
    var d = new Date(v);
    return isNaN(d.getTime()) ? null : d;
  }

  function fmtAgo(v) {
    var d = toDate(v);
    if (!d) return "–";
    var s = (Date.now() - d.getTime()) / 1000;
    if (s < 5) return "just now";
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return Math.round(s / 3600) + " h ago";
    return d.toLocaleDateString();
  }

  function fmtDate(v) { var d = toDate(v); return d ? d.toLocaleString() : "–"; }

  /* TensorBoard's debiased EMA: last = w·last + (1−w)·y; debias = w·debias + (1−w); s = last/debias.
     Missing values stay missing and do not move the average. */
  function smooth(ys, w) {
    var out = new Array(ys.length), last = 0, debias = 0;
    for (var i = 0; i < ys.length; i++) {
      var y = ys[i];
      if (y === null || y === undefined || !isFinite(y)) { out[i] = null; continue; }
      last = w * last + (1 - w) * y;
      debias = w * debias + (1 - w);
      out[i] = last / debias;
    }
    return out;
  }

  function flatten(obj, prefix, out) {
    out = out || {};
    Object.keys(obj || {}).forEach(function (k) {
      var v = obj[k], key = prefix ? prefix + "." + k : k;
      if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, key, out);
      else out[key] = v;
    });
    return out;
  }

  function fmtValue(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "number") return String(v);
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }

  function setState(node, state) {
    node.textContent = state || "unknown";
    node.setAttribute("data-state", state || "");
    node.className = "state state-" + (state || "unknown");
  }

  /* an opaque colour between `hex` and white (stacked areas must not blend into each other) */
  function tint(hex, amount) {
    var n = parseInt(hex.slice(1), 16);
    var mix = function (c) { return Math.round(c + (255 - c) * amount); };
    return "rgb(" + mix(n >> 16 & 255) + "," + mix(n >> 8 & 255) + "," + mix(n & 255) + ")";
  }

  function debounce(fn, ms) {
    var t = null;
    return function () { clearTimeout(t); t = setTimeout(fn, ms); };
  }

  // ---------------------------------------------------------------- charts

  function axisFmt(u, vals) { return vals.map(function (v) { return fmt(v, 3); }); }

  var AXIS = { stroke: "#495057", grid: { stroke: "#e9ecef", width: 1 }, ticks: { stroke: "#dee2e6", width: 1 },
    font: "11px system-ui, -apple-system, 'Segoe UI', sans-serif" };

  function axes(extra) {
    var x = Object.assign({}, AXIS, { space: 60 });
    var y = Object.assign({}, AXIS, { values: axisFmt, size: 56 });
    return [x, y].concat(extra || []);
  }

  function chartWidth(node) { return Math.max(200, Math.floor(node.clientWidth || node.parentNode.clientWidth || 400)); }
  function chartHeight(node) { return node.classList.contains("chart-tall") ? 300 : 190; }

  /* with the cursor off the chart the legend shows the latest values instead of dashes */
  function legendLast(u) {
    if (u.cursor.idx !== null && u.cursor.idx !== undefined) return;
    var n = u.data && u.data[0] ? u.data[0].length : 0;
    if (n) u.setLegend({ idx: n - 1 });
  }

  function makeChart(node, series, data, extra) {
    var opts = Object.assign({
      width: chartWidth(node),
      height: chartHeight(node),
      scales: { x: { time: false } },
      axes: axes(),
      series: [{ label: "step", value: function (u, v) { return v === null || v === undefined ? "–" : fmtInt(v); } }]
        .concat(series),
      legend: { live: true },
      cursor: { drag: { x: true, y: false }, points: { size: 6 } },
      hooks: { setCursor: [legendLast], setData: [legendLast] }
    }, extra || {});
    node.textContent = "";
    return new uPlot(opts, data, node);
  }

  function line(label, color, more) {
    return Object.assign({
      label: label, stroke: color, width: 1.5, points: { show: false }, spanGaps: true,
      value: function (u, v) { return fmt(v, 4); }
    }, more || {});
  }

  function resizeAll(charts) {
    charts.forEach(function (c) {
      if (!c || !c.plot) return;
      var w = chartWidth(c.node);
      if (Math.abs(w - c.plot.width) > 1) c.plot.setSize({ width: w, height: chartHeight(c.node) });
    });
  }

  // ---------------------------------------------------------------- run page

  function RunPage(runId) {
    this.id = runId;
    this.base = "/api/runs/" + encodeURIComponent(runId);
    this.m = { step: [] };
    this.smoothing = parseFloat($("#smoothing").value);
    this.state = null;
    this.checkpoints = [];
    this.samples = {};
    this.es = null;
    this.drawPending = false;
    this.logsTimer = null;
    this.logsDue = 0;
    this.zoom = null;            // [min, max] steps of a drag selection: kept over live updates
    this.stopRequested = false;  // a stop sent from this page, until the run reaches a terminal state
  }

  RunPage.prototype.start = function () {
    var self = this;
    this.initCharts();
    this.bindControls();
    this.loadRun();
    this.loadCheckpoints();
    this.loadSamples();
    this.loadLogs();
    this.pollSystem();
    setInterval(function () { self.pollSystem(); }, 2000);
    setInterval(function () { if (self.isRunning()) self.loadCheckpoints(); }, 5000);
    this.loadMetrics().then(function () { self.connect(); });
    window.addEventListener("resize", debounce(function () { resizeAll(self.charts); }, 150));
  };

  RunPage.prototype.isRunning = function () { return this.state === "running" || this.state === "restarting"; };

  RunPage.prototype.message = function (text, kind) {
    var m = $("#run-message");
    m.textContent = text || "";
    m.hidden = !text;
    m.className = "message banner" + (kind ? " " + kind : "");
  };

  /* every chart shares one x range: the zoom when one was selected, else all steps drawn */
  RunPage.prototype.xRange = function () {
    var s = this.m.step;
    if (this.zoom) return this.zoom;
    if (!s.length) return [0, 1];
    var lo = s[0], hi = s[s.length - 1];
    return lo === hi ? [lo - 1, hi + 1] : [lo, hi];
  };

  /* zoom (a [min, max] selection) or, with null, show all steps again, on every chart */
  RunPage.prototype.setZoom = function (zoom) {
    this.zoom = zoom;
    var r = this.xRange();
    this.charts.forEach(function (c) { if (c.plot) c.plot.setScale("x", { min: r[0], max: r[1] }); });
  };

  RunPage.prototype.initCharts = function () {
    var self = this;
    var xRange = function () { return self.xRange(); };
    // a drag selects a range: setZoom applies it to all charts (uPlot's own setScale would be undone by
    // xRange); a double-click (after uPlot's own handler) shows all steps again
    var onSelect = function (u) {
      if (u.select.width < 2) return;
      var zoom = [u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x")];
      u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
      self.setZoom(zoom);
    };
    var sync = { key: "run-" + this.id, setSeries: false };
    var common = { scales: { x: { time: false, range: xRange } },
      cursor: { sync: sync, drag: { x: true, y: false, setScale: false } },
      hooks: { setCursor: [legendLast], setData: [legendLast], setSelect: [onSelect] } };
    function spec(id) { return { node: document.getElementById(id), plot: null }; }
    this.cLoss = spec("chart-loss");
    this.cLr = spec("chart-lr");
    this.cGrad = spec("chart-grad-norm");
    this.cScale = spec("chart-loss-scale");
    this.cSpeed = spec("chart-speed");
    this.cTiming = spec("chart-timing");
    this.charts = [this.cLoss, this.cLr, this.cGrad, this.cScale, this.cSpeed, this.cTiming];
    if (typeof uPlot === "undefined") { this.message("chart library failed to load", "error"); return; }

    this.cLoss.plot = makeChart(this.cLoss.node, [
      line("raw", "rgba(31,111,178,0.28)", { width: 1 }),
      line("smoothed", "#1f6fb2", { width: 2 }),
      line("validation", "#d9480f", { width: 2, points: { show: true, size: 5, fill: "#d9480f" } })
    ], [[], [], [], []], common);
    this.cLr.plot = makeChart(this.cLr.node, [line("lr", "#7048e8", {
      value: function (u, v) { return v === null || v === undefined ? "–" : v.toExponential(2); }
    })], [[], []], Object.assign({}, common, {
      axes: axes().map(function (a, i) {
        return i === 1 ? Object.assign({}, a, { values: function (u, vals) { return vals.map(function (v) { return v.toExponential(1); }); } }) : a;
      })
    }));
    this.cGrad.plot = makeChart(this.cGrad.node, [line("grad norm", "#c92a2a", {
      points: { show: true, size: 3, fill: "#c92a2a" }
    })], [[], []], common);
    this.cScale.plot = makeChart(this.cScale.node, [line("loss scale", "#8c564b")], [[], []], common);
    this.cSpeed.plot = makeChart(this.cSpeed.node, [
      line("ms/step", "#2b8a3e", { scale: "ms" }),
      line("tokens/s", "#e67700", { scale: "tps" })
    ], [[], [], []], Object.assign({}, common, {
      scales: { x: common.scales.x, ms: { auto: true }, tps: { auto: true } },
      axes: [
        Object.assign({}, AXIS, { space: 60 }),
        Object.assign({}, AXIS, { scale: "ms", values: axisFmt, size: 50, label: "ms/step", labelSize: 14, labelFont: AXIS.font }),
        Object.assign({}, AXIS, { scale: "tps", side: 1, values: axisFmt, size: 56, grid: { show: false },
          label: "tokens/s", labelSize: 14, labelFont: AXIS.font })
      ]
    }));
    // stacked area: the cumulative top is drawn first, each lower band paints over it
    var timingSeries = TIMING.slice().reverse().map(function (t) {
      var idx = TIMING.indexOf(t);
      return {
        label: t.label, stroke: t.color, width: 1, fill: tint(t.color, 0.35), points: { show: false },
        fillTo: function () { return 0; },
        value: function (u, v, si, i) {
          if (i === null || i === undefined) return "–";
          var raw = self.m[TIMING[idx].key][i];
          return raw === null || raw === undefined ? "–" : fmt(raw, 3) + " ms";
        }
      };
    });
    this.cTiming.plot = makeChart(this.cTiming.node, timingSeries, [[]].concat(TIMING.map(function () { return []; })),
      Object.assign({}, common, { scales: { x: common.scales.x, y: { range: function (u, min, max) { return [0, max > 0 ? max * 1.05 : 1]; } } } }));
    this.charts.forEach(function (c) {
      c.plot.over.addEventListener("dblclick", function () { self.setZoom(null); });
    });
  };

  RunPage.prototype.bindControls = function () {
    var self = this;
    var slider = $("#smoothing");
    var onSlide = function () {
      self.smoothing = Math.min(0.999, Math.max(0, parseFloat(slider.value) || 0));
      $("#smoothing-value").textContent = self.smoothing.toFixed(3);
      self.cLoss.node.setAttribute("data-smoothing", String(self.smoothing));
      self.drawLoss();
    };
    slider.addEventListener("input", onSlide);
    slider.addEventListener("change", onSlide);

    $("#stop-btn").addEventListener("click", function () {
      this.disabled = true;
      self.stopRequested = true;
      setState($("#state"), "stopping");
      api(self.base + "/stop", "POST", {}).then(function () {
        // (the run may have ended already: setStatus then cleared stopRequested)
        if (self.stopRequested) self.message("Stop requested: the trainer checkpoints and exits.", "info");
      }).catch(function (e) {
        self.stopRequested = false;
        self.message("Stop failed: " + errText(e), "error");
        self.loadRun();
      });
    });
    $("#resume-btn").addEventListener("click", function () {
      var b = this;
      b.disabled = true;
      api(self.base + "/resume", "POST", {}).then(function () {
        self.message("Resumed from the latest checkpoint.", "info");
        self.setStatus({ state: "running" });
        self.reconnect();
      }).catch(function (e) {
        self.message("Resume failed: " + errText(e), "error");
        self.loadRun();
      });
    });

    $("#generate-form").addEventListener("submit", function (ev) {
      ev.preventDefault();
      var btn = $("#generate-btn"), out = $("#generate-output");
      var body = {
        prompt: $("#generate-prompt").value,
        temperature: parseFloat($("#generate-temperature").value),
        top_k: parseInt($("#generate-topk").value, 10),
        max_tokens: parseInt($("#generate-tokens").value, 10)
      };
      if (!isFinite(body.temperature)) delete body.temperature;
      if (!isFinite(body.top_k)) delete body.top_k;
      if (!isFinite(body.max_tokens)) delete body.max_tokens;
      btn.disabled = true;
      out.className = "generated pending";
      out.textContent = "generating…";
      api(self.base + "/generate", "POST", body).then(function (r) {
        out.className = "generated";
        out.textContent = "";
        out.appendChild(el("span", { className: "meta", text: "checkpoint at step " + fmtInt(r.step) }));
        out.appendChild(el("div", { className: "text", text: r.text }));
        out.setAttribute("data-step", String(r.step));
      }).catch(function (e) {
        out.className = "generated error";
        out.textContent = "Generation failed: " + errText(e);
      }).then(function () { btn.disabled = false; });
    });
  };

  RunPage.prototype.loadRun = function () {
    var self = this;
    return api(this.base).then(function (r) {
      self.setStatus(r.status || { state: r.state });
      self.renderConfig(r.config || {});
      self.renderSummary(r.summary || {});
      var c = r.config || {}, spec = c.spec || {};
      var sub = [c.model_name || spec.model, c.params ? fmt(c.params / 1e6, 3) + "M params" : null,
        c.device || spec.backend, spec.precision].filter(Boolean).join(" · ");
      $("#run-subtitle").textContent = sub;
    }).catch(function (e) { self.message("Could not load the run: " + errText(e), "error"); });
  };

  RunPage.prototype.setStatus = function (st) {
    if (!st) return;
    var prev = this.state;
    this.state = st.state || this.state;
    this.status = Object.assign({}, this.status || {}, st);
    var running = this.isRunning();
    if (this.stopRequested && TERMINAL[this.state]) {
      this.stopRequested = false;
      this.message("");
    }
    setState($("#state"), this.stopRequested && running ? "stopping" : this.state);
    $("#stop-btn").disabled = !running || this.stopRequested;
    var hasCkpt = this.checkpoints.some(function (c) { return c.name === "latest.ckpt"; });
    $("#resume-btn").disabled = running || !hasCkpt || this.state === "finished";
    if (this.state === "failed" && st.error) this.message("Run failed: " + st.error, "error");
    var s = this.status;
    if (s.step !== undefined && s.steps) {
      $("#stat-step").textContent = fmtInt(s.step) + " / " + fmtInt(s.steps);
      $("#progress").max = s.steps;
      $("#progress").value = Math.min(s.step, s.steps);
    }
    // the trainer's live figures (status.json): the latest loss and the best validation loss so far
    if (st.loss !== undefined) $("#stat-loss").textContent = fmt(st.loss, 4);
    if (st.best_val_loss !== undefined) $("#stat-best").textContent = fmt(st.best_val_loss, 4);
    if (prev && prev !== this.state && TERMINAL[this.state]) {
      this.loadCheckpoints();
      this.loadRun();
    }
  };

  RunPage.prototype.renderSummary = function (s) {
    if (s.last_loss !== undefined) $("#stat-loss").textContent = fmt(s.last_loss, 4);
    if (s.best_val_loss !== undefined) $("#stat-best").textContent = fmt(s.best_val_loss, 4);
    if (s.tokens_per_s !== undefined) $("#stat-tps").textContent = fmtInt(s.tokens_per_s);
    if (s.ms_step !== undefined) $("#stat-ms").textContent = fmt(s.ms_step, 3);
  };

  var CONFIG_GROUPS = { spec: "Run spec", model: "Model" };

  /* one definition list per part of config.json: the run spec, the model, then the other fields;
     each value carries its flattened name (as in the compare view) in data-field */
  RunPage.prototype.renderConfig = function (cfg) {
    var box = $("#config"), flat = flatten(cfg), groups = {};
    Object.keys(flat).forEach(function (k) {
      var dot = k.indexOf("."), group = dot > 0 ? k.slice(0, dot) : "";
      (groups[group] = groups[group] || []).push(k);
    });
    box.textContent = "";
    Object.keys(CONFIG_GROUPS).concat(Object.keys(groups).filter(function (g) { return !CONFIG_GROUPS[g]; }))
      .forEach(function (g) {
        if (!groups[g]) return;
        var dl = el("dl", { className: "kv" });
        groups[g].forEach(function (k) {
          dl.appendChild(el("dt", { text: g ? k.slice(g.length + 1) : k }));
          dl.appendChild(el("dd", { "data-field": k, text: fmtValue(flat[k]) }));
        });
        var title = el("h3", { text: CONFIG_GROUPS[g] || g || "Run" });
        box.appendChild(el("section", { className: "config-group" }, [title, dl]));
      });
  };

  // -- metrics

  RunPage.prototype.loadMetrics = function () {
    var self = this;
    return api(this.base + "/metrics?since_step=-1&max_points=2000").then(function (cols) {
      METRIC_KEYS = Object.keys(cols);
      METRIC_KEYS.forEach(function (k) { self.m[k] = cols[k].slice(); });
      var n = self.m.step.length;
      METRIC_KEYS.forEach(function (k) {
        while (self.m[k].length < n) self.m[k].push(null);
      });
      self.draw();
    }).catch(function (e) { self.message("Could not load metrics: " + errText(e), "error"); });
  };

  RunPage.prototype.addRows = function (rows) {
    var m = this.m;
    for (var r = 0; r < rows.length; r++) {
      var row = rows[r];
      if (!row || typeof row.step !== "number") continue;
      var n = m.step.length;
      if (n && row.step === m.step[n - 1]) {
        // more of the same step (its validation loss): fill in what the row has
        METRIC_KEYS.forEach(function (k) { if (row[k] !== undefined) m[k][n - 1] = row[k]; });
        continue;
      }
      if (n && row.step < m.step[n - 1]) {
        // a replay or a resume that re-produces steps: drop what it overwrites
        var i = n;
        while (i > 0 && m.step[i - 1] >= row.step) i--;
        METRIC_KEYS.forEach(function (k) { m[k].length = i; });
      }
      METRIC_KEYS.forEach(function (k) { m[k].push(row[k] === undefined ? null : row[k]); });
    }
    if (m.step.length > MAX_POINTS) {
      // every other point, but every validation point and the last one
      var keep = [];
      for (var j = 0; j < m.step.length; j++) {
        if (j % 2 === 0 || m.val_loss[j] !== null || j === m.step.length - 1) keep.push(j);
      }
      METRIC_KEYS.forEach(function (k) { m[k] = keep.map(function (q) { return m[k][q]; }); });
    }
    var last = rows[rows.length - 1];
    if (last) {
      var mean = function (a) {
        var s = 0, c = 0;
        for (var q = Math.max(0, a.length - 20); q < a.length; q++) if (a[q] !== null && isFinite(a[q])) { s += a[q]; c++; }
        return c ? s / c : null;
      };
      this.renderSummary({ last_loss: last.loss, tokens_per_s: mean(m.tokens_per_s), ms_step: mean(m.ms_step) });
      if (this.status && this.status.steps) {
        this.setStatus({ step: Math.max(this.status.step || 0, last.step) });   // step S: S micro-steps done
      }
    }
    this.scheduleDraw();
  };

  RunPage.prototype.scheduleDraw = function () {
    var self = this;
    if (this.drawPending) return;
    this.drawPending = true;
    setTimeout(function () { self.drawPending = false; self.draw(); }, 120);
  };

  RunPage.prototype.drawLoss = function () {
    var m = this.m, c = this.cLoss;
    if (!m.loss) return;  // the metrics are not loaded yet
    var sm = smooth(m.loss, this.smoothing);
    if (c.plot) c.plot.setData([m.step, m.loss, sm, m.val_loss]);
    c.node.setAttribute("data-points", String(m.step.length));
    c.node.setAttribute("data-val-points", String(m.val_loss.filter(function (v) { return v !== null; }).length));
    c.node.setAttribute("data-smoothing", String(this.smoothing));
    for (var i = sm.length - 1; i >= 0; i--) {
      if (sm[i] !== null) {
        c.node.setAttribute("data-last-smoothed", String(sm[i]));
        c.node.setAttribute("data-last-raw", String(m.loss[i]));
        break;
      }
    }
  };

  RunPage.prototype.draw = function () {
    var m = this.m, n = m.step.length;
    if (!m.loss) return;
    this.drawLoss();
    if (this.cLr.plot) this.cLr.plot.setData([m.step, m.lr]);
    this.cLr.node.setAttribute("data-points", String(n));

    var gx = [], gy = [];
    for (var i = 0; i < n; i++) {
      var g = m.grad_norm[i];
      if (g !== null && g !== undefined && isFinite(g)) { gx.push(m.step[i]); gy.push(g); }
    }
    if (this.cGrad.plot) this.cGrad.plot.setData([gx, gy]);
    this.cGrad.node.setAttribute("data-points", String(gx.length));

    if (this.cScale.plot) this.cScale.plot.setData([m.step, m.loss_scale]);
    this.cScale.node.setAttribute("data-points", String(n));

    if (this.cSpeed.plot) this.cSpeed.plot.setData([m.step, m.ms_step, m.tokens_per_s]);
    this.cSpeed.node.setAttribute("data-points", String(n));

    var cum = TIMING.map(function () { return new Array(n); });
    for (var j = 0; j < n; j++) {
      var acc = 0;
      for (var t = 0; t < TIMING.length; t++) {
        var v = m[TIMING[t].key][j];
        acc += (v === null || v === undefined || !isFinite(v)) ? 0 : v;
        cum[t][j] = acc;
      }
    }
    if (this.cTiming.plot) this.cTiming.plot.setData([m.step].concat(cum.reverse()));
    this.cTiming.node.setAttribute("data-points", String(n));
  };

  // -- live stream

  RunPage.prototype.connect = function () {
    var self = this;
    if (typeof EventSource === "undefined") return;
    // replay from the last step already drawn, so nothing written since the initial load is lost
    var n = this.m.step.length;
    var since = n ? this.m.step[n - 1] : -1;
    var es = new EventSource(this.base + "/events?since_step=" + encodeURIComponent(since));
    this.es = es;
    var live = $("#live");
    var setLive = function (on, text) { live.setAttribute("data-live", on); live.textContent = text; };
    es.addEventListener("open", function () { setLive("on", "live"); });
    es.addEventListener("metrics", function (e) {
      var d = JSON.parse(e.data);
      self.addRows(Array.isArray(d) ? d : (d.rows || []));
    });
    es.addEventListener("log", function () { self.scheduleLogs(); });
    es.addEventListener("sample", function (e) { self.addSample(JSON.parse(e.data)); });
    es.addEventListener("status", function (e) { self.setStatus(JSON.parse(e.data)); });
    es.addEventListener("done", function () {
      es.close();
      if (self.es === es) self.es = null;
      setLive("off", "ended");
      self.loadRun();
      self.loadCheckpoints();
      self.scheduleLogs();
    });
    es.addEventListener("error", function () {
      if (es.readyState === EventSource.CLOSED) setLive("off", "offline");
      else setLive("wait", "reconnecting");
    });
  };

  RunPage.prototype.reconnect = function () {
    var self = this;
    if (this.es) { this.es.close(); this.es = null; }
    // give the new trainer a moment to truncate metrics past its checkpoint, then reload
    setTimeout(function () { self.loadMetrics().then(function () { self.connect(); }); }, 800);
  };

  // -- logs, samples, system, checkpoints

  RunPage.prototype.scheduleLogs = function () {
    var self = this, now = Date.now();
    if (this.logsTimer) return;
    var wait = Math.max(0, this.logsDue - now);
    this.logsTimer = setTimeout(function () {
      self.logsTimer = null;
      self.logsDue = Date.now() + 1000;
      self.loadLogs();
    }, wait);
  };

  RunPage.prototype.loadLogs = function () {
    var pre = $("#logs");
    return api(this.base + "/logs?tail=300").then(function (r) {
      var lines = (r && r.lines) || [];
      var atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 24;
      pre.textContent = lines.length ? lines.join("\n") : "(no output yet)";
      pre.setAttribute("data-lines", String(lines.length));
      if ($("#logs-follow").checked || atBottom) pre.scrollTop = pre.scrollHeight;
    }).catch(function () { /* the run may not have a log yet */ });
  };

  RunPage.prototype.loadSamples = function () {
    var self = this;
    return api(this.base + "/samples").then(function (r) {
      ((r && r.samples) || []).forEach(function (s) { self.addSample(s, true); });
      self.renderSamples();
    }).catch(function () {});
  };

  RunPage.prototype.addSample = function (s, noRender) {
    if (!s || s.text === undefined) return;
    this.samples[s.step] = s.text;
    if (!noRender) this.renderSamples();
  };

  RunPage.prototype.renderSamples = function () {
    var box = $("#samples"), samples = this.samples;
    var steps = Object.keys(samples).map(Number).sort(function (a, b) { return b - a; });
    box.textContent = "";
    box.setAttribute("data-count", String(steps.length));
    if (!steps.length) { box.appendChild(el("p", { className: "empty", text: "No samples yet." })); return; }
    steps.slice(0, 3).forEach(function (st) {
      box.appendChild(el("div", { className: "sample" }, [
        el("span", { className: "meta", text: "step " + fmtInt(st) }),
        el("div", { className: "text", text: samples[st] })
      ]));
    });
  };

  RunPage.prototype.pollSystem = function () {
    var box = $("#system");
    if (this.systemBusy) return;
    this.systemBusy = true;
    var self = this;
    api(this.base + "/system").then(function (s) {
      var set = function (f, text) { var d = $('[data-field="' + f + '"]', box); if (d) d.textContent = text; };
      set("pid", s.pid === null || s.pid === undefined ? "–" : String(s.pid));
      set("alive", s.alive ? "yes" : "no");
      set("cpu_percent", s.cpu_percent === null || s.cpu_percent === undefined ? "–" : s.cpu_percent.toFixed(1) + " %");
      set("rss_mb", s.rss_mb === null || s.rss_mb === undefined ? "–" : s.rss_mb.toFixed(1) + " MB");
      box.setAttribute("data-alive", s.alive ? "true" : "false");
      box.setAttribute("data-updated", String(Date.now()));
    }).catch(function () {}).then(function () { self.systemBusy = false; });
  };

  RunPage.prototype.loadCheckpoints = function () {
    var self = this, list = $("#checkpoints");
    return api(this.base + "/checkpoints").then(function (r) {
      var cks = (r && r.checkpoints) || [];
      self.checkpoints = cks;
      list.textContent = "";
      list.setAttribute("data-count", String(cks.length));
      if (!cks.length) list.appendChild(el("li", { className: "empty", text: "No checkpoints yet." }));
      cks.forEach(function (c) {
        var href = self.base + "/checkpoints/" + encodeURIComponent(c.name);
        list.appendChild(el("li", null, [
          el("a", { className: "checkpoint-link", href: href, download: c.name, text: c.name }),
          el("span", { className: "meta", text: fmtBytes(c.bytes) + " · " + fmtAgo(c.modified) }),
          el("code", { className: "sha", title: "sha256 " + (c.sha256 || ""), text: (c.sha256 || "").slice(0, 12) })
        ]));
      });
      self.setStatus({});
    }).catch(function () {});
  };

  // ---------------------------------------------------------------- index page

  function IndexPage() {
    this.presets = null;   // GET /api/presets: the form's choices and defaults
    this.rows = {};
    this.selected = {};
    this.compareChart = null;
    this.compareData = null;
  }

  IndexPage.prototype.start = function () {
    var self = this;
    this.bindForm();
    this.loadPresets();
    this.loadRuns();
    setInterval(function () { if (!document.hidden) self.loadRuns(); }, 3000);
    $("#compare-btn").addEventListener("click", function () { self.compare(); });
    $("#compare-smoothing").addEventListener("input", function () {
      $("#compare-smoothing-value").textContent = parseFloat(this.value).toFixed(3);
      self.drawCompare();
    });
    $("#diff-only").addEventListener("change", function () {
      $("#config-diff").classList.toggle("only-diff", this.checked);
    });
    window.addEventListener("resize", debounce(function () {
      if (self.compareChart) resizeAll([{ node: $("#compare-chart"), plot: self.compareChart }]);
    }, 150));
  };

  /* the choices, and every default as the placeholder of its field: the run spec's defaults, and for
     steps, lr, accum and warmup the selected preset's schedule (all from /api/presets) */
  IndexPage.prototype.loadPresets = function () {
    var self = this, form = $("#start-form");
    return api("/api/presets").then(function (p) {
      self.presets = p;
      var choose = function (name, values, titles) {
        var s = form.elements[name];
        s.textContent = "";
        values.forEach(function (v) {
          s.appendChild(el("option", { value: v, text: v, title: titles && titles[v] }));
        });
        s.value = p.defaults[name];
      };
      var desc = {};
      Object.keys(p.presets).forEach(function (n) {
        var d = p.presets[n];
        desc[n] = "dim " + d.dim + ", " + d.layers + " layers, " + d.heads + " heads, seq " + d.seq;
      });
      choose("model", Object.keys(p.presets), desc);
      choose("backend", p.backends);
      choose("precision", p.precisions);
      form.elements.dynamic_loss_scale.checked = p.defaults.dynamic_loss_scale;
      self.showDefaults();
    }).catch(function (e) {
      var msg = $("#start-message");
      msg.className = "message error";
      msg.textContent = "Could not load the presets: " + errText(e);
    });
  };

  IndexPage.prototype.showDefaults = function () {
    var p = this.presets, form = $("#start-form");
    var schedule = p.schedules[form.elements.model.value] || {};
    $all("input[type=number], input[type=text]", form).forEach(function (inp) {
      var v = inp.name in schedule ? schedule[inp.name] : p.defaults[inp.name];
      if (v !== null && v !== undefined) inp.placeholder = String(v);
    });
  };

  IndexPage.prototype.bindForm = function () {
    var self = this, form = $("#start-form"), msg = $("#start-message");
    form.elements.model.addEventListener("change", function () { if (self.presets) self.showDefaults(); });
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      var body = {}, bad = null;
      $all("input[name], select[name]", form).forEach(function (inp) {
        var name = inp.name, v = inp.value.trim();
        if (inp.type === "checkbox") {
          if (self.presets && inp.checked !== self.presets.defaults[name]) body[name] = inp.checked;
          return;
        }
        if (inp.validity.badInput) { bad = bad || name; return; }   // (its value reads as "")
        if (v === "") return;  // a field left blank takes its default (the placeholder)
        if (inp.type === "number") {
          var n = Number(v);   // the server checks the type and range (422 naming the field)
          if (!isFinite(n)) { bad = bad || name; return; }
          body[name] = n;
        } else body[name] = v;
      });
      if (bad) { msg.className = "message error"; msg.textContent = bad + ": not a valid number"; return; }
      var btn = $("#start-btn");
      btn.disabled = true;
      msg.className = "message";
      msg.textContent = "starting…";
      api("/api/runs", "POST", body).then(function (r) {
        msg.textContent = "started " + r.id;
        window.location.href = "/runs/" + encodeURIComponent(r.id);
      }).catch(function (e) {
        btn.disabled = false;
        msg.className = "message error";
        msg.textContent = errText(e);
      });
    });
  };

  IndexPage.prototype.loadRuns = function () {
    var self = this;
    return api("/api/runs").then(function (r) { self.renderRuns((r && r.runs) || []); }).catch(function () {});
  };

  IndexPage.prototype.renderRuns = function (runs) {
    var self = this, body = $("#runs-table tbody");
    $("#runs-empty").hidden = runs.length > 0;
    var seen = {};
    runs.forEach(function (run, i) {
      seen[run.id] = true;
      var tr = self.rows[run.id];
      if (!tr) {
        var cb = el("input", { type: "checkbox", className: "compare-select", value: run.id,
          "aria-label": "select " + run.id + " for comparison" });
        cb.addEventListener("change", function () {
          if (this.checked) self.selected[run.id] = true; else delete self.selected[run.id];
          self.updateCompareButton();
        });
        tr = el("tr", { "data-run-id": run.id }, [
          el("td", { className: "col-select" }, [cb]),
          el("td", { className: "col-id" }, [el("a", { href: "/runs/" + encodeURIComponent(run.id), text: run.id })]),
          el("td", { className: "col-model" }), el("td", { className: "col-state" }),
          el("td", { className: "col-progress" }), el("td", { className: "col-loss num" }),
          el("td", { className: "col-best num" }), el("td", { className: "col-updated" })
        ]);
        self.rows[run.id] = tr;
      }
      $(".col-model", tr).textContent = run.model_name || "–";
      var st = $(".col-state", tr);
      st.textContent = "";
      var badge = el("span");
      setState(badge, run.state);
      if (run.error) badge.title = run.error;
      st.appendChild(badge);
      var pr = $(".col-progress", tr);
      pr.textContent = "";
      if (run.steps) {
        var p = el("progress", { max: run.steps, value: Math.min(run.step || 0, run.steps) });
        pr.appendChild(p);
        pr.appendChild(el("span", { className: "meta", text: fmtInt(run.step || 0) + " / " + fmtInt(run.steps) }));
      } else pr.textContent = "–";
      $(".col-loss", tr).textContent = fmt(run.last_loss, 4);
      $(".col-best", tr).textContent = fmt(run.best_val_loss, 4);
      var up = $(".col-updated", tr);
      up.textContent = fmtAgo(run.updated || run.created);
      up.title = "created " + fmtDate(run.created) + "\nupdated " + fmtDate(run.updated);
      if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
    });
    Object.keys(this.rows).forEach(function (id) {
      if (!seen[id]) { self.rows[id].remove(); delete self.rows[id]; delete self.selected[id]; }
    });
    this.updateCompareButton();
  };

  IndexPage.prototype.updateCompareButton = function () {
    var n = Object.keys(this.selected).length;
    $("#compare-btn").disabled = n < 2;
    $("#compare-hint").textContent = n < 2 ? "select two or more runs to compare" : n + " runs selected";
  };

  IndexPage.prototype.compare = function () {
    var self = this;
    var ids = $all("input.compare-select:checked").map(function (c) { return c.value; });
    if (ids.length < 2) return;
    var section = $("#compare-section");
    section.hidden = false;
    $("#compare-title").textContent = ids.length + " runs";
    var btn = $("#compare-btn");
    btn.disabled = true;
    Promise.all(ids.map(function (id) {
      var base = "/api/runs/" + encodeURIComponent(id);
      return Promise.all([api(base), api(base + "/metrics?since_step=-1&max_points=2000")])
        .then(function (res) { return { id: id, run: res[0], metrics: res[1] }; });
    })).then(function (runs) {
      self.compareData = runs;
      self.drawCompare();
      self.renderDiff(runs);
      section.scrollIntoView({ behavior: "auto", block: "start" });
    }).catch(function (e) {
      $("#compare-title").textContent = "failed: " + errText(e);
    }).then(function () { self.updateCompareButton(); });
  };

  IndexPage.prototype.drawCompare = function () {
    var runs = this.compareData, node = $("#compare-chart");
    if (!runs || typeof uPlot === "undefined") return;
    var w = parseFloat($("#compare-smoothing").value) || 0;
    // one shared x axis: the union of all steps; each run is null where it has no point
    var xsSet = {};
    runs.forEach(function (r) { (r.metrics.step || []).forEach(function (s) { xsSet[s] = true; }); });
    var xs = Object.keys(xsSet).map(Number).sort(function (a, b) { return a - b; });
    var pos = {};
    xs.forEach(function (s, i) { pos[s] = i; });
    var total = 0;
    var ys = runs.map(function (r) {
      var steps = r.metrics.step || [], loss = smooth(r.metrics.loss || [], w);
      var col = new Array(xs.length).fill(null);
      steps.forEach(function (s, i) { col[pos[s]] = loss[i]; });
      total += steps.length;
      return col;
    });
    var series = runs.map(function (r, i) {
      var c = r.run.config || {};
      var label = r.id + (c.model_name ? " (" + c.model_name + ")" : "");
      return line(label, PALETTE[i % PALETTE.length], { width: 2 });
    });
    if (this.compareChart) { this.compareChart.destroy(); this.compareChart = null; }
    node.classList.add("chart-tall");
    this.compareChart = makeChart(node, series, [xs].concat(ys));
    node.setAttribute("data-series", String(runs.length));
    node.setAttribute("data-points", String(total));
    node.setAttribute("data-smoothing", String(w));
  };

  var FIELD_ORDER = ["model_name", "spec.", "model.", "params", "active_vocab", "device"];

  function fieldRank(k) {
    for (var i = 0; i < FIELD_ORDER.length; i++) {
      var f = FIELD_ORDER[i];
      if (k === f || (f.slice(-1) === "." && k.indexOf(f) === 0)) return i;
    }
    return FIELD_ORDER.length;
  }

  IndexPage.prototype.renderDiff = function (runs) {
    var table = $("#config-diff"), head = $("thead", table), body = $("tbody", table);
    head.textContent = "";
    body.textContent = "";
    var flats = runs.map(function (r) { return flatten(r.run.config || {}); });
    var keys = {};
    flats.forEach(function (f) { Object.keys(f).forEach(function (k) { keys[k] = true; }); });
    var sorted = Object.keys(keys).sort(function (a, b) {
      return fieldRank(a) - fieldRank(b) || (a < b ? -1 : a > b ? 1 : 0);
    });
    head.appendChild(el("tr", null, [el("th", { text: "field" })].concat(runs.map(function (r, i) {
      var sw = el("span", { className: "swatch" });
      sw.style.background = PALETTE[i % PALETTE.length];
      return el("th", null, [sw, el("a", { href: "/runs/" + encodeURIComponent(r.id), text: r.id })]);
    }))));
    var ndiff = 0;
    sorted.forEach(function (k) {
      var vals = flats.map(function (f) { return f[k]; });
      var first = JSON.stringify(vals[0]);
      var differs = vals.some(function (v) { return JSON.stringify(v) !== first; });
      if (differs) ndiff++;
      body.appendChild(el("tr", { className: differs ? "diff" : null, "data-field": k },
        [el("th", { text: k })].concat(vals.map(function (v) { return el("td", { text: fmtValue(v) }); }))));
    });
    table.setAttribute("data-diff-count", String(ndiff));
  };

  // ---------------------------------------------------------------- boot

  function boot() {
    var page = document.body.getAttribute("data-page");
    if (page === "run") {
      window.anectypesPage = new RunPage(document.body.getAttribute("data-run-id"));
    } else if (page === "index") {
      window.anectypesPage = new IndexPage();
    } else return;
    window.anectypesPage.start();
  }

  window.anectypes = { smooth: smooth, flatten: flatten };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", boot);
  else boot();
})();
