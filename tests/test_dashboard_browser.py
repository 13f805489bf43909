"""Browser tests of the dashboard: Playwright (PyPI) driving Debian's chromium against the real
`python -m anectypes.dashboard`, started as a subprocess on a free port with a temporary runs folder.

Every test records all requests of its browser context and asserts that none left 127.0.0.1, and
that the page logged no console error and raised no page error. Screenshots of the main views go
to test-artifacts/ under the repository root.

Without chromium or playwright these tests are skipped, except when the environment variable CI is
set (CI installs both), where they fail.
"""

import csv
import datetime
import hashlib
import io
import json
import math
import os
import re
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit
from xml.etree import ElementTree

import numpy as np
import pytest

from support.dashboard_server import Dashboard, fake_trainer

from anectypes.formats.checkpoint import load_checkpoint, save_checkpoint
from anectypes.model.config import ModelConfig, init_params
from anectypes.runs import RunDir

pytestmark = pytest.mark.slow

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:                                   # pragma: no cover - depends on the machine
    sync_playwright = None

CHROMIUM = "/usr/bin/chromium"
# dashboard-notes §4.2; Playwright adds a fresh profile itself (never pass --user-data-dir here)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
TERMINAL = ("finished", "stopped", "failed", "cancelled")
VIEWPORT = {"width": 1280, "height": 800}

shared = {}                                           # run ids handed from one test to the next


def in_ci():
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing_tools():
    missing = []
    if sync_playwright is None:
        missing.append("the playwright package (pip install playwright)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    return missing


@pytest.fixture(scope="module", autouse=True)
def browser_tools():
    missing = missing_tools()
    if missing:
        msg = "browser tests need " + " and ".join(missing)
        if in_ci():
            pytest.fail(msg + " (CI is set, so this is an error)", pytrace=False)
        pytest.skip(msg)


# --- the dashboard server --------------------------------------------------------------------------

class Server(Dashboard):
    """The dashboard with the calls these tests make to its API (plain urllib, no token)."""

    def api(self, path, body=None, method=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def wait_run(self, run_id, pred, timeout=60.0, what="condition"):
        deadline = time.monotonic() + timeout
        while True:
            detail = self.api(f"/api/runs/{run_id}")
            if pred(detail):
                return detail
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id}: timed out waiting for {what}; last: {detail['status']}")
            time.sleep(0.2)

    def wait_terminal(self, run_id, timeout=90.0):
        detail = self.wait_run(run_id, lambda d: d["state"] in TERMINAL, timeout, "a terminal state")
        assert detail["state"] != "failed", detail["status"]
        return detail

    def stop_runs(self):
        """Stop whatever earlier tests left queued or running, for a test that needs the training slot
        (the dashboard runs one at a time)."""
        for r in self.api("/api/runs")["runs"]:
            if r["state"] not in TERMINAL:
                self.api(f"/api/runs/{r['id']}/stop", {})
                self.wait_run(r["id"], lambda d: d["state"] in TERMINAL, what="its stop")

    def checkpoint_names(self, run_id):
        return [c["name"] for c in self.api(f"/api/runs/{run_id}/checkpoints")["checkpoints"]]


@pytest.fixture(scope="module")
def server(tmp_path_factory, browser_tools):
    runs_dir = tmp_path_factory.mktemp("dashboard-runs")
    srv = Server(runs_dir, runs_dir.parent / "dashboard-server.log", env={"PYTHONUNBUFFERED": "1"}).start()
    yield srv
    srv.stop(timeout=20, check=False)                  # the dashboard stops its runs on the way out


# --- the browser -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(server):
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class Watched:
    """A page whose requests, console errors and page errors are all recorded."""

    def __init__(self, context, page):
        self.context, self.page = context, page
        self.requests, self.console_errors, self.page_errors = [], [], []
        context.on("request", lambda r: self.requests.append(r.url))
        page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))

    def allow(self, status):
        """An HTTP error the test provoked: chromium logs the failed fetch as a console error."""
        self.console_errors = [m for m in self.console_errors if f"status of {status}" not in m]

    def check(self):
        foreign = [u for u in self.requests
                   if urlsplit(u).scheme not in ("data", "blob", "about") and urlsplit(u).hostname != "127.0.0.1"]
        assert self.requests, "no requests were recorded at all"
        assert not foreign, f"requests left 127.0.0.1: {foreign}"
        assert not self.console_errors, f"console errors: {self.console_errors}"
        assert not self.page_errors, f"page errors: {self.page_errors}"


def open_watched(browser, **context_options):
    context = browser.new_context(**{"viewport": VIEWPORT, "accept_downloads": True, **context_options})
    page = context.new_page()
    page.set_default_timeout(20_000)
    return Watched(context, page)


@pytest.fixture
def watched(browser):
    w = open_watched(browser)
    yield w
    w.context.close()
    w.check()                                          # also when a test forgot to


def screenshot(page, name, **kw):
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), **kw)


def attr_number(page, selector, name):
    value = page.get_attribute(selector, name)
    return float(value) if value not in (None, "") else None


def wait_attr_above(page, selector, name, minimum, timeout=30_000):
    page.wait_for_function(
        "([sel, name, min]) => { const e = document.querySelector(sel);"
        " return e && Number(e.getAttribute(name)) > min; }", arg=[selector, name, minimum], timeout=timeout)
    return attr_number(page, selector, name)


def ref_smooth(ys, w):
    """TensorBoard's debiased EMA, as the page must compute it."""
    out, last, debias = [], 0.0, 0.0
    for y in ys:
        last = w * last + (1 - w) * y
        debias = w * debias + (1 - w)
        out.append(last / debias)
    return out


# --- the tests ---------------------------------------------------------------------------------------

def test_start_run_from_form_live_charts_smoothing_stop_resume(server, watched):
    page = watched.page
    page.goto(server.base + "/")
    page.wait_for_selector("#start-form select[name=model] option[value=tiny]", state="attached")
    form = page.locator("#start-form")
    form.locator("select[name=model]").select_option("tiny")
    form.locator("input[name=steps]").fill("600")
    form.locator("select[name=precision]").select_option("fp32")
    form.locator("select[name=backend]").select_option("sim")
    form.locator("input[name=seed]").fill("1")
    form.locator("input[name=sample_every]").fill("40")
    form.locator("details.more summary").click()
    form.locator("input[name=save_every]").fill("5")
    page.click("#start-btn")
    page.wait_for_url("**/runs/*")
    run_id = page.get_attribute("body", "data-run-id")
    assert run_id and page.url.endswith("/runs/" + run_id)
    shared["run1"] = run_id

    # the loss chart gains points live, from the SSE stream
    first = wait_attr_above(page, "#chart-loss", "data-points", 0)
    grown = wait_attr_above(page, "#chart-loss", "data-points", first + 20)
    assert grown > first
    assert page.text_content("#state") in ("running", "restarting")

    # stop: the trainer checkpoints and exits, the page follows
    page.wait_for_selector("#stop-btn:enabled")
    page.click("#stop-btn")
    page.wait_for_function("() => ['stopped', 'finished'].includes(document.querySelector('#state').textContent)")
    stopped = page.text_content("#state") != "finished"    # (a very fast machine may finish first)
    expect(page.locator("#run-message")).to_be_hidden()    # no "Stop requested" left once it has stopped

    for chart in ("#chart-lr", "#chart-loss-scale", "#chart-ms", "#chart-tps", "#chart-timing", "#chart-cpu",
                  "#chart-rss"):
        assert attr_number(page, chart, "data-points") > 0, chart
    assert 0 < attr_number(page, "#chart-grad-norm", "data-points") < attr_number(page, "#chart-loss", "data-points")
    assert page.locator("#chart-loss canvas").count() == 1

    # smoothing: the slider is reflected on the chart and the smoothed line leaves the raw one
    def last_values():
        return page.evaluate("() => { const e = document.querySelector('#chart-loss');"
                             " return [Number(e.dataset.lastSmoothed), Number(e.dataset.lastRaw)]; }")

    page.fill("#smoothing", "0.95")
    assert page.get_attribute("#chart-loss", "data-smoothing") == "0.95"
    assert page.text_content("#smoothing-value") == "0.950"
    smoothed, raw = last_values()
    assert math.isfinite(smoothed) and math.isfinite(raw) and abs(smoothed - raw) > 1e-6, (smoothed, raw)
    page.fill("#smoothing", "0")
    assert page.get_attribute("#chart-loss", "data-smoothing") == "0"
    smoothed, raw = last_values()
    assert smoothed == pytest.approx(raw, rel=1e-12)
    page.fill("#smoothing", "0.6")
    ys = [3.0, 2.0, 2.5, 1.0, 1.7]
    assert page.evaluate("(ys) => window.anectypes.smooth(ys, 0.6)", ys) == pytest.approx(ref_smooth(ys, 0.6))
    assert page.evaluate("(ys) => window.anectypes.smooth(ys, 0)", ys) == pytest.approx(ys)

    # resume: a new trainer continues from the checkpoint and the chart keeps growing
    if stopped:
        page.wait_for_selector("#resume-btn:enabled")
        at_stop = attr_number(page, "#chart-loss", "data-points")
        page.click("#resume-btn")
        page.wait_for_function(
            "(n) => Number(document.querySelector('#chart-loss').dataset.points) > n + 10"
            " || document.querySelector('#state').textContent === 'finished'", arg=at_stop, timeout=30_000)

    # samples written by the trainer, the logs tail and the trainer's stats show up
    page.wait_for_selector("#samples .sample .text")
    page.wait_for_function("() => Number(document.querySelector('#logs').dataset.lines || 0) > 0")
    page.wait_for_function("() => /^\\d+$/.test(document.querySelector('#system [data-field=pid]').textContent)")

    server.wait_terminal(run_id, timeout=600)         # (600 steps: 2 min on a loaded 2-core machine)
    page.wait_for_function("() => document.querySelector('#state').textContent === 'finished'"
                           " && document.querySelector('#chart-loss').dataset.points === '600'")
    expect(page.locator("#run-message")).to_be_hidden()          # no "Resumed from ..." once it has ended
    expect(page.locator("#stat-step")).to_have_text("600 / 600")
    watched.check()


def _finished_run(server):
    """The run of the first test, or (when that one failed) a fresh short run started via the API."""
    run_id = shared.get("run1")
    if run_id is None:
        run_id = server.api("/api/runs", {"model": "tiny", "steps": 120, "precision": "fp32", "backend": "sim",
                                          "seed": 1, "sample_every": 40, "save_every": 5})["id"]
        shared["run1"] = run_id
    server.wait_terminal(run_id, timeout=600)
    assert "latest.ckpt" in server.checkpoint_names(run_id)
    return run_id


def test_generation_streams_its_tokens_to_the_page(server, watched):
    """A model slow enough that 200 tokens take a while (random weights; BOS's embedding row is zero, so
    greedy never ends early): the page shows the text growing before the last token has come."""
    cfg = ModelConfig(dim=256, hidden=768, heads=4, kv_heads=4, head_dim=64, layers=4, seq=256, vocab=1024)
    rd = RunDir(server.runs_dir / "streaming")
    rd.checkpoints.mkdir(parents=True)                   # a run folder's writes never make its folder
    rd.write_config(dict(run_id="streaming", spec={"model": "tiny"}, model=cfg.to_dict(), model_name="streaming"))
    params = init_params(cfg, np.random.default_rng(0))
    params["embed"][1] = 0
    zero = {k: np.zeros_like(v) for k, v in params.items()}
    save_checkpoint(rd.latest, cfg, params, dict(t=0, m=zero, v=zero), {"step": 3})
    page = watched.page
    page.goto(f"{server.base}/runs/streaming")
    page.evaluate("""() => {
        const out = document.querySelector('#generate-output');
        window.seen = [];
        new MutationObserver(() => seen.push({length: (out.querySelector('.text')?.textContent || '').length,
                                               done: out.hasAttribute('data-step')}))
            .observe(out, {subtree: true, childList: true, characterData: true, attributes: true});
    }""")
    page.fill("#generate-prompt", "Once upon a time")
    page.fill("#generate-temperature", "0")
    page.fill("#generate-tokens", "200")
    page.click("#generate-btn")
    page.wait_for_selector("#generate-output[data-step='3']", timeout=60_000)
    final = len(page.locator("#generate-output .text").text_content())
    growing = {s["length"] for s in page.evaluate("seen") if not s["done"] and len("Once upon a time") < s["length"] < final}
    assert len(growing) >= 2, f"the text did not grow token by token: {page.evaluate('seen')}"
    assert "200 tokens" in page.locator("#generate-output .meta").text_content()
    watched.check()


def test_generate_and_download_checkpoint(server, watched):
    run_id = _finished_run(server)
    page = watched.page
    page.goto(f"{server.base}/runs/{run_id}")
    page.wait_for_function("() => document.querySelector('#state').textContent === 'finished'")
    wait_attr_above(page, "#chart-loss", "data-points", 0)

    page.fill("#generate-prompt", "Once upon a time")
    page.fill("#generate-temperature", "0.8")
    page.click("#generate-btn")
    page.wait_for_selector("#generate-output[data-step]")
    text = page.locator("#generate-output .text").text_content()
    assert text and text.strip(), "no generated text"
    assert page.get_attribute("#generate-output", "data-step") is not None
    assert "error" not in (page.get_attribute("#generate-output", "class") or "")

    link = page.locator("#checkpoints a.checkpoint-link", has_text="latest.ckpt")
    link.wait_for()
    assert link.get_attribute("href") == f"/api/runs/{run_id}/checkpoints/latest.ckpt"
    assert link.get_attribute("download") is not None
    with page.expect_download() as info:
        link.click()
    download = info.value
    step = load_checkpoint(server.runs_dir / run_id / "checkpoints" / "latest.ckpt").state["step"]
    assert download.suggested_filename == f"{run_id}-latest-step{step}.ckpt"     # not one more latest.ckpt
    assert f"step {step}" in link.locator("xpath=..").text_content()
    on_disk = (server.runs_dir / run_id / "checkpoints" / "latest.ckpt").read_bytes()
    got = Path(download.path()).read_bytes()
    assert got == on_disk
    sha = page.get_attribute("#checkpoints li:has(a.checkpoint-link:text-is('latest.ckpt')) code.sha", "title")
    assert sha == "sha256 " + hashlib.sha256(on_disk).hexdigest()

    page.wait_for_selector("#samples .sample")
    screenshot(page, "dashboard-run.png", full_page=True)
    watched.check()


def test_export_downloads_the_gguf_and_says_why_not(server, watched, tmp_path):
    from anectypes import sources
    from anectypes.formats.export import export
    run_id = _finished_run(server)
    page = watched.page
    page.goto(f"{server.base}/runs/{run_id}")
    page.wait_for_function("() => document.querySelector('#state').textContent === 'finished'")
    page.select_option("#export-format", "gguf")
    with page.expect_download() as info:
        page.click("#export-btn")
    download = info.value
    assert download.suggested_filename == f"{run_id}-gguf.gguf"
    expected = tmp_path / "expected.gguf"
    export(sources.resolve(server.runs_dir / run_id), "gguf", expected)
    assert Path(download.path()).read_bytes() == expected.read_bytes()
    expect(page.locator("#export-status")).to_have_attribute("data-file", f"{run_id}-gguf.gguf")
    page.select_option("#export-format", "llama2c")
    page.select_option("#export-dtype", "f16")
    page.click("#export-btn")
    expect(page.locator("#export-status")).to_have_text(
        "Export failed: cannot export: llama2.c's run.c reads float32 only: --dtype f16 is for hf and gguf")
    watched.allow(409)
    watched.check()


def test_compare_two_runs(server, watched):
    run1 = _finished_run(server)
    run2 = server.api("/api/runs", {"model": "tiny", "steps": 60, "precision": "fp32", "backend": "sim",
                                    "seed": 7, "sample_every": 0})["id"]
    server.wait_terminal(run2)
    page = watched.page
    page.goto(server.base + "/")
    for rid in (run1, run2):
        page.locator(f"#runs-table input.compare-select[value='{rid}']").check()
    screenshot(page, "dashboard-index.png")
    page.click("#compare-btn")
    page.wait_for_selector("#compare-chart[data-series='2'] canvas")
    # x + the loss and the validation loss of each run
    assert page.locator("#compare-chart .u-legend .u-series").count() == 1 + 2 * 2
    legend = page.text_content("#compare-chart .u-legend")
    assert run1 in legend and run2 in legend and f"{run1} validation" in legend
    points = sum(len(server.api(f"/api/runs/{r}/metrics?max_points=2000")["step"]) for r in (run1, run2))
    assert attr_number(page, "#compare-chart", "data-points") == points >= 120 + 60
    plotted = "() => window.anectypesPage.compareChart.data"

    # another metric, over tokens seen, log scale: the runs' own values
    page.select_option("#compare-metric", "grad_norm")
    page.select_option("#compare-x", "tokens")
    page.check("#compare-section input.log-y")
    expect(page.locator("#compare-chart")).to_have_attribute("data-metric", "grad_norm")
    assert page.locator("#compare-chart .u-legend .u-series").count() == 1 + 2           # no validation
    assert page.evaluate("() => window.anectypesPage.compareChart.scales.y.distr") == 3
    cols = server.api(f"/api/runs/{run2}/metrics?max_points=2000")
    want = {s * 64: g for s, g in zip(cols["step"], cols["grad_norm"]) if g is not None}
    page.fill("#compare-smoothing", "0")
    xs, *ys = page.evaluate(plotted)
    k = page.evaluate("(id) => window.anectypesPage.compareChart.series.findIndex(s => s.label.startsWith(id))", run2)
    got = {x: g for x, g in zip(xs, ys[k - 1]) if g is not None}
    assert got == pytest.approx(want) and len(got) >= 60 // 2 - 1
    page.select_option("#compare-x", "step")

    diff = page.locator("#config-diff tbody tr.diff")
    differing = {diff.nth(i).get_attribute("data-field") for i in range(diff.count())}
    assert {"spec.seed", "spec.steps"} <= differing, differing
    assert page.locator("#config-diff tbody tr[data-field='model.dim']:not(.diff)").count() == 1
    head = page.text_content("#config-diff thead")
    assert run1 in head and run2 in head
    row = page.locator("#config-diff tbody tr[data-field='spec.seed'] td").all_text_contents()
    assert sorted(row) == sorted(["1", "7"])
    screenshot(page.locator("#compare-section"), "dashboard-compare.png")
    page.check("#diff-only")
    assert page.locator("#config-diff tbody tr[data-field='model.dim']").is_hidden()
    watched.check()


def test_form_defaults_come_from_presets(server, watched):
    presets = server.api("/api/presets")
    defaults, schedules = presets["defaults"], presets["schedules"]
    other = next(name for name in presets["presets"] if name != defaults["model"])
    page = watched.page
    page.goto(server.base + "/")
    form = page.locator("#start-form")
    page.wait_for_function("() => document.querySelector('#start-form [name=save_every]').placeholder !== ''")

    def placeholder(name):
        return float(form.locator(f"[name={name}]").get_attribute("placeholder"))

    for name in ("clip", "seed", "sample_every", "log_every", "save_every", "min_lr_frac", "loss_scale"):
        assert placeholder(name) == defaults[name], name
        assert form.locator(f"[name={name}]").input_value() == "", name          # blank: the default
    for name in ("model", "backend", "precision"):
        assert form.locator(f"select[name={name}]").input_value() == defaults[name], name
    for name in ("dynamic_loss_scale", "exact_accum"):
        assert form.locator(f"[name={name}]").is_checked() == defaults[name], name
    for model in (defaults["model"], other):                    # steps, lr, accum, warmup: the preset's
        form.locator("select[name=model]").select_option(model)
        assert {k: placeholder(k) for k in schedules[model]} == schedules[model], model

    # fields left blank are not sent: the server fills in the same defaults
    posted = []

    def refuse(route):
        if route.request.method != "POST":
            return route.continue_()
        posted.append(route.request.post_data_json)
        route.fulfill(status=409, json={"detail": "busy"})

    page.route("**/api/runs", refuse)
    page.click("#start-btn")
    expect(page.locator("#start-message")).to_have_text("busy")
    assert posted == [{"model": other, "backend": defaults["backend"], "precision": defaults["precision"]}]
    page.locator("details.more summary").click()                # a box checked against its default is sent
    form.locator("[name=exact_accum]").check()
    page.click("#start-btn")
    expect(page.locator("#start-message")).to_have_text("busy")
    assert posted[1] == {**posted[0], "exact_accum": True}
    form.locator("[name=report_to]").fill("tensorboard,mlflow")     # --report-to, as typed
    page.click("#start-btn")
    expect(page.locator("#start-message")).to_have_text("busy")
    assert posted[2] == {**posted[1], "report_to": "tensorboard,mlflow"}
    watched.allow(409)
    watched.check()


def _running_run(server):
    """A long run with frequent validation (every 4 micro-steps), running while the tests below look at it."""
    if "live" not in shared:
        _finished_run(server)                          # one run at a time
        shared["live"] = server.api("/api/runs", {"model": "tiny", "steps": 3000, "precision": "fp32",
                                                  "backend": "sim", "seed": 3, "sample_every": 0,
                                                  "save_every": 2, "log_every": 5})["id"]
    return shared["live"]


def no_scroll_box(page, selector):
    """Whether nothing between the element and the page scrolls (it is not hidden in a scroll box)."""
    return page.evaluate("(sel) => { for (let e = document.querySelector(sel); e && e !== document.body;"
                         " e = e.parentElement) if (e.scrollHeight > e.clientHeight + 1"
                         " && getComputedStyle(e).overflowY !== 'visible') return false; return true; }", selector)


def check_config_panel(server, page, run_id):
    spec = server.api(f"/api/runs/{run_id}")["config"]["spec"]
    for name in ("lr", "steps", "seed", "save_every"):
        cell = page.locator(f"#config [data-field='spec.{name}']")
        expect(cell).to_be_visible()
        assert float(cell.text_content()) == spec[name], name
        assert no_scroll_box(page, f"#config [data-field='spec.{name}']"), name
    for name in ("dim", "layers"):
        expect(page.locator(f"#config [data-field='model.{name}']")).to_be_visible()


def test_live_progress_in_list_and_run_page(server, watched):
    run_id = _running_run(server)
    page = watched.page
    page.goto(server.base + "/")
    page.wait_for_selector("#start-form select[name=model] option", state="attached")
    # the list shows the trainer's live step, loss and best validation loss while it runs
    page.wait_for_function(
        "(id) => { const tr = document.querySelector(`#runs-table tr[data-run-id='${id}']`);"
        " return tr && /^[1-9][\\d,]* \\/ 3,000$/.test(tr.querySelector('.col-progress .meta').textContent)"
        " && tr.querySelector('.col-loss').textContent !== '–'"
        " && tr.querySelector('.col-best').textContent !== '–'; }", arg=run_id)
    row = page.locator(f"#runs-table tr[data-run-id='{run_id}']")
    assert row.locator(".col-state").text_content() == "running"

    # a second run is queued: its page says so, and it can be cancelled
    page.click("#start-btn")
    page.wait_for_url("**/runs/*")
    queued = page.get_attribute("body", "data-run-id")
    assert queued != run_id
    expect(page.locator("#state")).to_have_text("queued")
    expect(page.locator("#run-message")).to_have_text("Queued, #1: it starts when a running run ends.")
    page.goto(server.base + "/")
    expect(page.locator(f"#runs-table tr[data-run-id='{queued}'] .col-progress")).to_have_text("queued, #1")
    page.goto(f"{server.base}/runs/{queued}")
    expect(page.locator("#stop-btn")).to_have_text("Cancel")
    page.click("#stop-btn")
    expect(page.locator("#state")).to_have_text("cancelled")
    assert server.api(f"/api/runs/{queued}")["state"] == "cancelled"

    # the run page follows status.json: the step and a best validation loss that improves while it runs
    page.goto(f"{server.base}/runs/{run_id}")
    page.wait_for_function("() => /^[1-9][\\d,]* \\/ 3,000$/.test(document.querySelector('#stat-step').textContent)"
                           " && document.querySelector('#stat-best').textContent !== '–'")
    at_load = float(page.text_content("#stat-best"))
    page.wait_for_function("(b) => Number(document.querySelector('#stat-best').textContent) < b", arg=at_load,
                           timeout=30_000)
    assert page.text_content("#stat-loss") != "–"
    assert page.text_content("#state") == "running"

    # validation losses: a third curve on the loss chart, with a legend entry, the values of the API
    wait_attr_above(page, "#chart-loss", "data-val-points", 1)
    assert page.locator("#chart-loss .u-legend .u-series", has_text="validation").count() == 1
    drawn = page.evaluate("() => { const d = window.anectypesPage.cLoss.plot.data;"
                          " return d[0].map((s, i) => [s, d[3][i]]).filter(p => p[1] !== null); }")
    cols = server.api(f"/api/runs/{run_id}/metrics?max_points=1000000")
    api_val = {s: v for s, v in zip(cols["step"], cols["val_loss"]) if v is not None}
    assert drawn and all(api_val.get(s) == pytest.approx(v) for s, v in drawn), (drawn, api_val)

    check_config_panel(server, page, run_id)
    watched.check()


def test_zoom_survives_live_updates(server, watched):
    run_id = _running_run(server)
    page = watched.page
    page.goto(f"{server.base}/runs/{run_id}")
    first = wait_attr_above(page, "#chart-loss", "data-points", 50)
    x_scales = "() => window.anectypesPage.charts.map(c => [c.plot.scales.x.min, c.plot.scales.x.max])"
    last_step = "() => window.anectypesPage.m.step[window.anectypesPage.m.step.length - 1]"

    box = page.locator("#chart-loss .u-over").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.3, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=8)
    page.mouse.up()
    zoom = page.evaluate(x_scales)[0]
    assert zoom[1] - zoom[0] > 0 and zoom[1] < page.evaluate(last_step), zoom

    wait_attr_above(page, "#chart-loss", "data-points", first + 30)          # live updates arrive
    for scale in page.evaluate(x_scales):                                   # every chart keeps the zoom
        assert scale == pytest.approx(zoom), (scale, zoom)

    page.locator("#chart-lr .u-over").dblclick()                            # all steps again
    for lo, hi in page.evaluate(x_scales):
        assert lo < zoom[0] and hi > zoom[1], (lo, hi, zoom)
    watched.check()


def test_stop_ends_stopped_without_banner(server, watched):
    run_id = _running_run(server)
    page = watched.page
    page.goto(f"{server.base}/runs/{run_id}")
    page.wait_for_selector("#stop-btn:enabled")
    page.click("#stop-btn")
    page.wait_for_function("() => document.querySelector('#state').textContent === 'stopped'")
    assert server.api(f"/api/runs/{run_id}")["state"] == "stopped"
    expect(page.locator("#run-message")).to_be_hidden()
    expect(page.locator("#resume-btn")).to_be_enabled()
    check_config_panel(server, page, run_id)                                # the same panel as while it ran
    watched.check()


# --- charts, look and access (issue 20) ---------------------------------------------------------------

T0 = 1_700_000_000.0


def synthetic_run(runs_dir, name, n, status=None, seq=64, ranks=1, loss=None, spec=None):
    """A run folder written by the test: n micro-steps of known metrics (wall time T0 + step/2 s, a
    gradient norm every other step, CPU and memory every 10, a validation loss every 50; on several
    ranks, each row's rank as MPI training writes it; loss(step) the loss, if given; spec: more run-spec
    fields of its config)."""
    rd = RunDir(runs_dir / name)
    rd.path.mkdir()
    cfg = ModelConfig(dim=64, hidden=176, heads=4, kv_heads=4, head_dim=16, layers=2, seq=seq, vocab=1024)
    rd.write_config(dict(run_id=name, spec={"model": "tiny", "steps": n, **(spec or {})}, model=cfg.to_dict(),
                         model_name="tiny"))
    rd.write_json("status.json", status or {"state": "finished", "step": n, "steps": n})
    with open(rd / "metrics.jsonl", "w") as f:
        f.writelines(metric_lines(1, n, ranks, loss))
    return rd


def metric_lines(first, last, ranks=1, loss=None):
    for s in range(first, last + 1):
        row = {"step": s, "loss": loss(s) if loss else 6 / (1 + s / 100), "lr": 1e-3, "grad_norm": 1 + 1 / s if s % 2 == 0 else None,
               "loss_scale": 256.0, "ms_step": 9 + s % 3, "tokens_per_s": 7000 - s % 5, "t_eval": 5.0, "t_io": 0.5,
               "t_cpu": 2.0, "t_cls": 1.0, "t_dw_wait": 0.25, "t": T0 + s / 2}
        if ranks > 1:
            row["rank"] = (s - 1) % ranks                  # micro-step j (0-based) runs on rank j mod N
        if s % 10 == 0:
            row.update(cpu_pct=95.0 + s % 7, rss_mb=80.0 + s / 1000)
        yield json.dumps(row) + "\n"
        if s % 50 == 0:
            yield json.dumps({"step": s, "val_loss": 6 / (1 + s / 90)}) + "\n"


def test_chart_axes_log_scale_tooltip_and_downloads(server, watched):
    synthetic_run(server.runs_dir, "charts", 300)
    page = watched.page
    page.goto(f"{server.base}/runs/charts")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "300")
    data = "(key) => window.anectypesPage.charts.find(c => c.key === key).plot.data"
    keys = page.evaluate("() => window.anectypesPage.charts.map(c => c.key)")
    assert {"ms", "tps", "cpu", "rss"} <= set(keys) and "speed" not in keys
    # the speed chart is two charts of one series each; the system metrics are charts over time
    for key, col in (("ms", "ms_step"), ("tps", "tokens_per_s")):
        xs, ys = page.evaluate(data, key)
        assert xs == list(range(1, 301)) and ys == [float(9 + s % 3) if col == "ms_step" else 7000 - s % 5 for s in xs]
    # one process: one step-time series, as before ranks had their own
    assert page.evaluate("() => window.anectypesPage.cMs.plot.series.map((s) => s.label)") == ["step", "ms/step"]
    xs, cpu, share = page.evaluate(data, "cpu")
    assert xs == list(range(10, 301, 10)) and cpu == [95.0 + s % 7 for s in xs]
    assert share == pytest.approx([100 * 5.0 / (9 + s % 3) for s in xs])              # t_eval / ms_step

    # the x axis: tokens seen and wall time on every chart, remembered over a reload
    page.select_option("#x-axis", "tokens")
    for key in keys:
        assert page.evaluate(data, key)[0][-1] == 300 * 64, key
    page.select_option("#x-axis", "time")
    for key in keys:
        assert page.evaluate(data, key)[0][-1] == pytest.approx(299 / 2), key
    assert page.text_content("#chart-loss .u-legend .u-series:first-child th") == "wall time"
    page.reload()
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "300")
    assert page.input_value("#x-axis") == "time" and page.evaluate(data, "loss")[0][0] == 0

    # log scale on the loss and the gradient norm
    for key in ("loss", "grad-norm"):
        card = page.locator(f".chart-card:has(#chart-{key})")
        card.locator("input.log-y").check()
        expect(page.locator(f"#chart-{key}")).to_have_attribute("data-log", "true")
        assert page.evaluate(f"() => window.anectypesPage.charts.find(c => c.key === '{key}').plot.scales.y.distr") == 3
    assert page.locator(".chart-card:has(#chart-lr) input.log-y").count() == 0
    assert page.evaluate(data, "loss")[1][:3] == pytest.approx([6 / (1 + s / 100) for s in (1, 2, 3)])

    # the tooltip: x and every series' value at the cursor, on the hovered chart only
    box = page.locator("#chart-loss .u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] / 2)
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2, steps=3)
    tip = page.locator("#chart-loss .chart-tip")
    expect(tip).to_be_visible()
    expect(page.locator("#chart-lr .chart-tip")).to_be_hidden()
    idx = page.evaluate("() => window.anectypesPage.cLoss.plot.cursor.idx")
    rows = tip.locator("div").all_text_contents()
    assert [r.split(" ")[0] for r in rows] == ["wall", "raw", "smoothed", "validation"]
    raw = page.evaluate(data, "loss")[1][idx]
    assert rows[1] == f"raw {float(f'{raw:.4g}'):g}", (rows, raw)

    # a chart's data as CSV (the x axis and its series) and its picture as PNG
    page.select_option("#x-axis", "step")
    with page.expect_download() as info:
        page.locator(".chart-card:has(#chart-loss) button", has_text="CSV").click()
    assert info.value.suggested_filename == "charts-loss.csv"
    table = list(csv.reader(io.StringIO(Path(info.value.path()).read_text())))
    assert table[0] == ["step", "raw", "smoothed", "validation"] and len(table) == 301
    assert [float(r[1]) for r in table[1:]] == pytest.approx([6 / (1 + s / 100) for s in range(1, 301)])
    assert {int(r[0]): float(r[3]) for r in table[1:] if r[3]} == pytest.approx({s: 6 / (1 + s / 90) for s in (50, 100, 150, 200, 250, 300)})
    with page.expect_download() as info:
        page.locator(".chart-card:has(#chart-timing) button", has_text="CSV").click()
    timing = list(csv.reader(io.StringIO(Path(info.value.path()).read_text())))
    assert timing[0][0] == "step" and timing[1][1:] == ["0.25", "1", "2", "0.5", "5"]       # each component's own
    with page.expect_download() as info:
        page.locator(".chart-card:has(#chart-loss) button", has_text="PNG").click()
    png = Path(info.value.path()).read_bytes()
    width = page.evaluate("() => window.anectypesPage.cLoss.plot.ctx.canvas.width")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") > width > 200
    # every row of the run, from the server
    with page.expect_download() as info:
        page.click("#metrics-csv")
    rows = list(csv.DictReader(io.StringIO(Path(info.value.path()).read_text())))
    assert info.value.suggested_filename == "charts-metrics.csv" and len(rows) == 300
    assert rows[49]["val_loss"] and float(rows[49]["t"]) == T0 + 25 and rows[48]["cpu_pct"] == ""
    watched.check()


def test_a_charts_png_and_svg_carry_its_title_legend_and_axis_names(server, watched):
    """Issue 36 §6: a downloaded picture says what it shows: the PNG is the chart with room for its title,
    axes' names and legend (larger than the bare chart in both directions), the SVG has them as text."""
    synthetic_run(server.runs_dir, "pictures", 300)
    page = watched.page
    page.goto(f"{server.base}/runs/pictures")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "300")
    bare = page.evaluate("() => { const c = window.anectypesPage.cLoss.plot.ctx.canvas; return [c.width, c.height]; }")
    card = page.locator(".chart-card:has(#chart-loss)")
    with page.expect_download() as info:
        card.locator("button", has_text="PNG").click()
    assert info.value.suggested_filename == "pictures-loss.png"
    w, h = png_size(Path(info.value.path()).read_bytes())
    assert w > bare[0] and h > bare[1] + 3 * 18, (w, h, bare)          # a title, the x axis' name, 3 legend lines
    with page.expect_download() as info:
        card.locator("button", has_text="SVG").click()
    assert info.value.suggested_filename == "pictures-loss.svg"
    svg = ElementTree.parse(info.value.path()).getroot()
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert texts == ["pictures: Loss", "step", "Loss", "raw", "smoothed", "validation"], texts
    # a chart with a hint names its y axis by it
    with page.expect_download() as info:
        page.locator(".chart-card:has(#chart-rss) button", has_text="SVG").click()
    texts = [t.text for t in ElementTree.parse(info.value.path()).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert texts[:3] == ["pictures: Trainer memory", "step", "RSS, MB"], texts
    watched.check()


SWEEP = {"col-a": {"lr": 1e-4, "seed": 1}, "col-b": {"lr": 1e-3, "seed": 2}, "col-c": {"lr": 1e-3, "seed": 3},
         "col-d": {"lr": 1e-2, "seed": 4}}
SWEEP_VAL = {"col-a": 0.9, "col-b": 0.7, "col-c": 0.8, "col-d": 1.1}        # each run's last (and lowest) validation loss

COLOURS = """() => { const c = (e) => e && getComputedStyle(e).backgroundColor, p = window.anectypesPage;
  const legend = [...document.querySelectorAll('#compare-chart .u-legend .u-series')];
  return Object.fromEntries(p.compared.map((id) => [id, {
    list: c(document.querySelector(`#runs-table tr[data-run-id="${id}"] .col-id .swatch`)),
    legend: getComputedStyle(legend[p.compareChart.series.findIndex((s) => s.label === id)].querySelector('.u-marker')).borderLeftColor,
    diff: c([...document.querySelectorAll('#config-diff thead th')].find((th) => th.textContent === id)?.querySelector('.swatch')) }])); }"""


def sweep_run(server, name):
    synthetic_run(server.runs_dir, name, 120, spec=SWEEP[name])
    with open(server.runs_dir / name / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 120, "val_loss": SWEEP_VAL[name]}) + "\n")


def compare_shown(page, n):
    page.check("#select-shown")
    page.click("#compare-btn")
    page.wait_for_selector(f"#compare-chart[data-series='{n}'] canvas")
    return page.evaluate(COLOURS)


def test_a_fourth_run_keeps_the_colours_and_a_chosen_config_column_survives_a_reload(server, watched):
    """Issue 36 §5: a run's colour comes from its id: the same in the list, the comparison's legend and its
    configuration table, and a fourth run (listed first, the newest) recolours none of the first three; the
    config columns chosen are in the URL; the notes show in the list."""
    for name in ("col-a", "col-b", "col-c"):
        sweep_run(server, name)
    server.api("/api/runs/col-b", {"notes": "warmup too short?"}, method="PATCH")
    page = watched.page
    page.goto(server.base + "/?q=col-")
    expect(page.locator("#runs-table tbody tr")).to_have_count(3)
    three = compare_shown(page, 3)
    assert all(c["list"] == c["legend"] == c["diff"] and c["list"].startswith("rgb") for c in three.values()), three
    assert len({c["list"] for c in three.values()}) == 3, three
    assert page.text_content("#runs-table tr[data-run-id='col-b'] .notes") == "warmup too short?"

    page.click(".column-chooser summary")
    for field in ("lr", "seed"):
        page.check(f"#column-choices input[value='{field}']")
    heads = page.locator("#runs-table thead th").all_text_contents()
    assert heads.index("lr") == heads.index("seed") - 1 == heads.index("Updated") - 2, heads
    cells = "() => [...document.querySelectorAll('#runs-table tbody tr')].map((tr) => [tr.dataset.runId, ...[...tr.querySelectorAll('td.col-spec')].map((td) => td.textContent)])"
    want = [[n, f"{SWEEP[n]['lr']:g}", str(SWEEP[n]["seed"])] for n in ("col-c", "col-b", "col-a")]
    assert page.evaluate(cells) == want
    page.locator("#runs-table th[data-sort='spec.lr'] button").click()
    assert [r[0] for r in page.evaluate(cells)] == ["col-a", "col-c", "col-b"]        # (b and c tie: listed order)
    assert "cols=lr%2Cseed" in page.url and "sort=spec.lr" in page.url

    sweep_run(server, "col-d")
    page.reload()
    expect(page.locator("#runs-table tbody tr")).to_have_count(4)
    assert page.locator("#runs-table thead th").all_text_contents() == heads
    assert [r[0] for r in page.evaluate(cells)][0] == "col-a" and page.evaluate(cells)[-1] == ["col-d", "0.01", "4"]
    assert page.locator("#column-choices input:checked").evaluate_all("(cs) => cs.map((c) => c.value)") == ["lr", "seed"]
    four = compare_shown(page, 4)
    assert {k: four[k] for k in three} == three, (three, four)
    assert four["col-d"]["list"] == four["col-d"]["legend"]
    rgb = {k: [int(v) for v in re.findall(r"\d+", c["list"])] for k, c in four.items()}
    close = [(a, b) for a in rgb for b in rgb if a < b and math.dist(rgb[a], rgb[b]) < 60]
    assert not close, (close, rgb)                            # four colours told apart at a glance
    # the comparison's picture names its runs in the legend, in their colours
    page.uncheck("#compare-val")
    with page.expect_download() as info:
        page.locator("#compare-section .chart-tools button", has_text="SVG").click()
    svg = ElementTree.parse(info.value.path()).getroot()
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert info.value.suggested_filename == "compare-loss.svg" and texts[:3] == ["Compare: loss", "step", "loss"], texts
    strokes = [ln.get("stroke") for ln in svg.iter("{http://www.w3.org/2000/svg}line")]
    rgb = page.evaluate("(cs) => cs.map((c) => { const e = document.createElement('i'); e.style.color = c;"
                        " document.body.append(e); const v = getComputedStyle(e).color; e.remove(); return v; })", strokes)
    assert dict(zip(texts[3:], rgb)) == {k: c["list"] for k, c in four.items()}, (texts, rgb)
    watched.check()


SCATTER = """() => { const u = window.anectypesPage.scatterChart;
  return { x: u.series[0].label, points: u.series.slice(1).map((s, k) => [s.label,
    ...u.data[0].flatMap((x, i) => (u.data[k + 1][i] === null ? [] : [[x, u.data[k + 1][i]]]))]) }; }"""


def test_a_sweeps_validation_loss_against_each_setting(server, watched):
    """Issue 36 §5: compared, the runs of a sweep are each one point at its setting (lr, or seed when chosen)
    and its best validation loss (the planted rows' lowest), in its colour."""
    for name in SWEEP:
        if not (server.runs_dir / name).exists():
            sweep_run(server, name)
    page = watched.page
    page.goto(server.base + "/?q=col-")
    expect(page.locator("#runs-table tbody tr")).to_have_count(4)
    compare_shown(page, 4)
    expect(page.locator("#scatter-chart")).to_have_attribute("data-points", "4")
    got = page.evaluate(SCATTER)
    best = {n: min([6 / (1 + s / 90) for s in (50, 100)] + [SWEEP_VAL[n]]) for n in SWEEP}
    assert got["x"] == "lr"
    assert {p[0]: p[1:] for p in got["points"]} == {n: [[pytest.approx(SWEEP[n]["lr"]), pytest.approx(best[n])]] for n in SWEEP}
    assert page.evaluate("() => window.anectypesPage.scatterChart.scales.x.distr") == 3       # lr spans decades: log
    page.select_option("#scatter-x", "spec.seed")
    got = page.evaluate(SCATTER)
    assert got["x"] == "seed"
    assert {p[0]: p[1:] for p in got["points"]} == {n: [[SWEEP[n]["seed"], pytest.approx(best[n])]] for n in SWEEP}
    assert "setting=spec.seed" in page.url
    watched.check()


def plant_samples(runs_dir, name, steps):
    with open(runs_dir / name / "samples.jsonl", "w") as f:
        f.writelines(json.dumps({"step": st, "text": f"{name} <b>at</b> {st}"}) + "\n" for st in steps)


def test_the_step_slider_shows_the_sample_of_the_chosen_step(server, watched):
    """Issue 36 §7: the run page's samples are a history: the slider starts at the latest, shows the sample of
    the step chosen (by the mouse or the arrow keys; in the URL over a reload), and its label names the step."""
    synthetic_run(server.runs_dir, "samples-run", 300)
    plant_samples(server.runs_dir, "samples-run", (50, 100, 150, 200))
    page = watched.page
    page.goto(f"{server.base}/runs/samples-run")
    shown = page.locator("#samples .sample")
    expect(shown).to_have_attribute("data-step", "200")
    expect(shown.locator(".text")).to_have_text("samples-run <b>at</b> 200")
    page.fill("#sample-step", "1")
    expect(shown).to_have_attribute("data-step", "100")
    expect(shown.locator(".text")).to_have_text("samples-run <b>at</b> 100")
    expect(page.locator("#sample-step-value")).to_have_text("step 100 (2 of 4)")
    assert page.get_attribute("#sample-step", "aria-valuetext") == "step 100 (2 of 4)"
    page.focus("#sample-step")
    page.keyboard.press("ArrowRight")
    expect(shown.locator(".text")).to_have_text("samples-run <b>at</b> 150")
    assert "sample=150" in page.url
    page.reload()
    expect(shown).to_have_attribute("data-step", "150")
    assert page.input_value("#sample-step") == "2"
    watched.check()


def test_compared_runs_samples_side_by_side_at_a_chosen_step(server, watched):
    """Issue 36 §7: the comparison shows each run's sample at the step chosen, its latest at or before it
    (runs sample at different steps)."""
    for name, steps in (("side-a", (50, 100, 150)), ("side-b", (60, 120))):
        synthetic_run(server.runs_dir, name, 200)
        plant_samples(server.runs_dir, name, steps)
    page = watched.page
    page.goto(server.base + "/?q=side-")
    expect(page.locator("#runs-table tbody tr")).to_have_count(2)
    page.check("#select-shown")
    page.click("#compare-btn")
    page.wait_for_selector("#compare-chart[data-series='2'] canvas")
    side = "() => [...document.querySelectorAll('#compare-samples .sample')].map((d) => [d.dataset.runId, d.dataset.step, d.querySelector('.text').textContent])"
    assert page.evaluate(side) == [["side-b", "120", "side-b <b>at</b> 120"], ["side-a", "150", "side-a <b>at</b> 150"]]
    page.fill("#compare-sample-step", "2")                                   # of 50, 60, 100, 120, 150: 100
    expect(page.locator("#compare-sample-value")).to_have_text("step 100 (3 of 5)")
    assert page.evaluate(side) == [["side-b", "60", "side-b <b>at</b> 60"], ["side-a", "100", "side-a <b>at</b> 100"]]
    page.fill("#compare-sample-step", "0")
    assert page.evaluate(side) == [["side-b", "", "no sample by this step"], ["side-a", "50", "side-a <b>at</b> 50"]]
    watched.check()


def drag(page, selector, start, end):
    """A mouse drag across a chart, from and to these fractions of its width."""
    box = page.locator(f"{selector} .u-over").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * start, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * end, y, steps=8)
    page.mouse.up()


COMPARE_VIEW = """() => { const c = window.anectypesPage.compareChart, q = (s) => document.querySelector(s);
  return { labels: c.series.map((s) => s.label), data: c.data, zoom: [c.scales.x.min, c.scales.x.max],
    distr: c.scales.y.distr, metric: q('#compare-metric').value, x: q('#compare-x').value,
    val: q('#compare-val').checked, smoothing: q('#compare-smoothing').value,
    log: q('#compare-section input.log-y').checked, filter: q('#filter-text').value,
    sort: [...document.querySelectorAll('#runs-table th[aria-sort]')].map((th) => [th.dataset.sort, th.getAttribute('aria-sort')]),
    rows: [...document.querySelectorAll('#runs-table tbody tr')].map((tr) => tr.dataset.runId) }; }"""


def test_a_compare_link_opened_in_a_new_page_shows_the_same_view(server, browser):
    """Issue 36 §4: the runs compared, the filter, the sort, the metric, the x axis, the smoothing, the log
    scale and a drag-zoom are in the page's URL; that URL opened in a new browser context (nothing in its
    storage) shows the same runs, rows and chart, point for point, and a reload the same again."""
    for name, n in (("view-a", 6000), ("view-b", 300), ("view-c", 350)):
        synthetic_run(server.runs_dir, name, n, loss=lambda s, n=n: n / (10 + s))
    first = open_watched(browser)
    page = first.page
    page.goto(server.base + "/")
    page.fill("#filter-text", "view-")
    for _ in range(2):                                                    # by name, descending
        page.locator("#runs-table th[data-sort='name'] button").click()
    for rid in ("view-a", "view-c"):
        page.locator(f"#runs-table input.compare-select[value='{rid}']").check()
    page.click("#compare-btn")
    page.wait_for_selector("#compare-chart[data-series='2'] canvas")
    page.select_option("#compare-metric", "grad_norm")
    page.select_option("#compare-x", "tokens")
    page.check("#compare-section input.log-y")
    page.fill("#compare-smoothing", "0.25")
    drag(page, "#compare-chart", 0.2, 0.6)
    zoomed = "() => window.anectypesPage.compareData.every((r) => r.detail)"      # (the range at full resolution)
    page.wait_for_function(zoomed)
    view = page.evaluate(COMPARE_VIEW)
    assert view["rows"] == ["view-c", "view-b", "view-a"] and view["sort"] == [["name", "descending"]]
    assert view["labels"] == ["tokens seen", "view-c", "view-a"] and view["distr"] == 3
    lo, hi = view["zoom"]
    assert 0 < lo < hi < 6000 * 64 and view["smoothing"] == "0.25"
    # view-a's 6,000 rows were down-sampled to 2,000; its zoomed range is drawn whole: a gradient norm every other step
    xs, a = view["data"][0], view["data"][view["labels"].index("view-a")]
    shown = [x for x, g in zip(xs, a) if g is not None and lo <= x <= hi]
    assert shown == [s * 64 for s in range(1, 6001) if s % 2 == 0 and lo <= s * 64 <= hi], (len(shown), lo, hi)
    url = page.url
    assert "compare=view-c%2Cview-a" in url, url
    first.context.close()
    first.check()

    second = open_watched(browser)
    page = second.page
    page.goto(url)
    page.wait_for_selector("#compare-chart[data-series='2'] canvas")
    page.wait_for_function(zoomed)
    assert page.evaluate(COMPARE_VIEW) == view
    page.reload()
    page.wait_for_selector("#compare-chart[data-series='2'] canvas")
    page.wait_for_function(zoomed)
    assert page.evaluate(COMPARE_VIEW) == view
    page.locator("#compare-chart .u-over").dblclick()                          # the zoom undone, in the URL too
    assert "zoom=" not in page.url and page.evaluate(COMPARE_VIEW)["zoom"][1] == 6000 * 64
    second.context.close()
    second.check()


RUN_VIEW = """() => { const p = window.anectypesPage, c = p.cLoss.plot;
  return { data: c.data, zoom: [c.scales.x.min, c.scales.x.max], distr: c.scales.y.distr, x: p.x,
    smoothing: document.querySelector('#smoothing').value, logs: p.charts.filter((c) => c.log).map((c) => c.key) }; }"""


def test_a_run_page_link_keeps_its_zoom_smoothing_x_axis_and_log_scale(server, browser):
    """Issue 36 §4: on a run page too, the URL carries the view; opened in a new context it is the same."""
    synthetic_run(server.runs_dir, "view-run", 3000, loss=spiky_loss)
    first = open_watched(browser)
    page = first.page
    page.goto(f"{server.base}/runs/view-run")
    wait_attr_above(page, "#chart-loss", "data-points", 1000)
    page.select_option("#x-axis", "time")
    page.fill("#smoothing", "0.2")
    page.locator(".chart-card:has(#chart-grad-norm) input.log-y").check()
    drag(page, "#chart-loss", 0.3, 0.5)
    page.wait_for_function("() => window.anectypesPage.detail !== null")
    view = page.evaluate(RUN_VIEW)
    assert view["x"] == "time" and view["logs"] == ["grad-norm"] and view["smoothing"] == "0.2"
    url = page.url
    first.context.close()
    first.check()

    second = open_watched(browser)                                   # (its x axis would be "step")
    page = second.page
    page.goto(url)
    page.wait_for_function("() => window.anectypesPage.detail !== null")
    assert page.evaluate(RUN_VIEW) == view
    assert page.input_value("#x-axis") == "time" and page.text_content("#smoothing-value") == "0.200"
    second.context.close()
    second.check()


AXIS_LABELS = "([key, axis]) => window.anectypesPage.charts.find((c) => c.key === key).plot.axes[axis]._values"


def test_axis_labels_are_whole_steps_distinct_and_engineering(server, watched):
    """Issue 36 §2: a 13-step run's step ticks are whole steps (not 3, 5, 8, 10, 13), tokens read 5k, 10k (not
    500000 beside 1.00e+6), the memory axis' labels differ from each other (not 56.6 twice), and a log axis
    labels its ticks or leaves them blank (not "–")."""
    synthetic_run(server.runs_dir, "ticks-short", 25)
    synthetic_run(server.runs_dir, "ticks", 1000)
    page = watched.page
    page.goto(f"{server.base}/runs/ticks-short")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "25")
    for key in page.evaluate("() => window.anectypesPage.charts.map((c) => c.key)"):     # wide and narrow charts
        labels = page.evaluate(AXIS_LABELS, [key, 0])
        splits = page.evaluate("(key) => window.anectypesPage.charts.find((c) => c.key === key).plot.axes[0]._splits", key)
        assert labels and [str(s) for s in splits] == labels and len(set(labels)) == len(labels), (key, labels, splits)
    page.goto(f"{server.base}/runs/ticks")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "1000")
    rss = page.evaluate(AXIS_LABELS, ["rss", 1])                      # 80.01 ... 81 MB
    assert len(rss) >= 3 and len(set(rss)) == len(rss), rss
    splits = page.evaluate("() => window.anectypesPage.charts.find((c) => c.key === 'rss').plot.axes[1]._splits")
    assert [float(v) for v in rss] == pytest.approx(splits, abs=1e-9)
    page.select_option("#x-axis", "tokens")                          # 64 to 64,000 tokens
    tokens = page.evaluate(AXIS_LABELS, ["loss", 0])
    assert tokens and all(re.fullmatch(r"\d+(\.\d+)?k?", v) for v in tokens) and len(set(tokens)) == len(tokens), tokens
    assert "50k" in tokens or "60k" in tokens, tokens
    page.locator(".chart-card:has(#chart-loss) input.log-y").check()
    logy = page.evaluate(AXIS_LABELS, ["loss", 1])
    assert "–" not in logy and any(logy) and len(set(filter(None, logy))) == len(list(filter(None, logy))), logy
    watched.check()


def test_a_queued_then_cancelled_run_shows_empty_charts_and_no_live_badge(browser, tmp_path):
    """Issue 36 §2: a queued run (a dashboard with --max-running 0) has no rows: its charts say so over whole-step
    axes, and its badge is not the green "live"; cancelled, the same with the note of a run that ended."""
    srv = Server(tmp_path / "runs", tmp_path / "server.log", args=["--max-running", "0"]).start()
    try:
        run_id = srv.api("/api/runs", {"model": "tiny", "steps": 50, "backend": "sim"})["id"]
        w = open_watched(browser)
        page = w.page
        page.goto(f"{srv.base}/runs/{run_id}")
        expect(page.locator("#state")).to_have_text("queued")
        expect(page.locator("#chart-loss .chart-empty")).to_have_text("No steps yet: the run is queued.")
        expect(page.locator("#live")).to_have_text("queued")
        assert page.get_attribute("#live", "data-live") != "on"
        labels = page.evaluate(AXIS_LABELS, ["loss", 0])
        assert len(set(labels)) == len(labels), labels                    # (was 0 0 0 0 0 1 1 1 1 1 1)
        page.click("#stop-btn")                                             # "Cancel"
        expect(page.locator("#state")).to_have_text("cancelled")
        expect(page.locator("#chart-loss .chart-empty")).to_have_text("No steps were recorded.")
        expect(page.locator("#chart-rss .chart-empty")).to_be_visible()
        expect(page.locator("#live")).to_have_text("ended")
        w.context.close()
        w.check()
    finally:
        srv.stop(timeout=20, check=False)


def test_the_step_tile_agrees_with_the_chart_and_a_failed_runs_log_lines_stay_apart(server, watched, trainer):
    """Issue 36 §3: status.json says step 40 while the metrics reach 42: the tile says 42 / 2,000 as the chart
    does. A trainer gone without a final status: the banner shows its last log lines one a line."""
    synthetic_run(server.runs_dir, "tile", 42, {**trainer(server.runs_dir / "tile"), "step": 40, "steps": 2000})
    page = watched.page
    page.goto(f"{server.base}/runs/tile")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "42")
    expect(page.locator("#stat-step")).to_have_text("42 / 2,000")
    assert page.evaluate("() => window.anectypesPage.cLoss.plot.data[0].at(-1)") == 42

    rd = synthetic_run(server.runs_dir, "killed", 30, {"state": "running", "step": 30, "steps": 100, "pid": 2 ** 22 + 1})
    lines = ["step 29 loss 5.1", "step 30 loss 5.0", "Killed"]
    (rd / "stdout.log").write_text("".join(f"{line}\n" for line in lines))
    page.goto(f"{server.base}/runs/killed")
    expect(page.locator("#state")).to_have_text("failed")
    shown = page.inner_text("#run-message").splitlines()
    assert shown[-3:] == lines, shown
    watched.check()


def axe_violations(page):
    """axe-core's serious and critical violations of the page (vendored: tests/vendor/axe-core-*)."""
    page.evaluate(AXE.read_text() + "\n;0")                 # (evaluate: the page's CSP forbids inline scripts)
    found = page.evaluate("async () => (await axe.run(document, {rules: AXE_MORE})).violations.map(v => ({id: v.id,"
                          " impact: v.impact, nodes: v.nodes.map(n => n.target.join(' '))}))"
                          .replace("AXE_MORE", json.dumps(AXE_MORE)))
    return [v for v in found if v["impact"] in ("serious", "critical")]


AXE = next((REPO / "tests" / "vendor").glob("axe-core-*/axe.min.js"))
# rules axe leaves off by default: a control's name holds its visible text (WCAG 2.5.3, for voice control),
# tap targets of at least 24 px (WCAG 2.5.8)
AXE_MORE = {"label-content-name-mismatch": {"enabled": True}, "target-size": {"enabled": True}}


def test_dark_mode_remembered_and_accessible(server, browser):
    synthetic_run(server.runs_dir, "looks", 120)
    w = open_watched(browser, color_scheme="dark")
    page = w.page
    page.goto(server.base + "/")
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")         # the system's choice
    bg = "() => getComputedStyle(document.body).backgroundColor"
    dark_bg = page.evaluate(bg)
    page.wait_for_selector("#runs-table tr[data-run-id='looks']")
    for url in ("/", "/runs/looks"):
        page.goto(server.base + url)
        page.wait_for_selector("#runs-table tbody tr, #chart-loss[data-points='120']")
        assert axe_violations(page) == [], url
    page.click("#theme-toggle")                                                   # light, remembered
    expect(page.locator("html")).to_have_attribute("data-theme", "light")
    expect(page.locator("#theme-toggle")).to_have_attribute("aria-pressed", "false")
    assert page.evaluate(bg) != dark_bg
    # the charts are redrawn in the theme's colours
    assert page.evaluate("() => window.anectypesPage.cLoss.plot.axes[0].stroke()") == "#495057"
    screenshot(page, "dashboard-run-light.png")
    page.reload()
    expect(page.locator("html")).to_have_attribute("data-theme", "light")
    page.wait_for_selector("#chart-loss[data-points='120']")
    assert axe_violations(page) == []
    page.goto(server.base + "/")
    page.wait_for_selector("#runs-table tbody tr")
    assert axe_violations(page) == []
    page.click("#theme-toggle")
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    w.context.close()
    w.check()


def test_runs_table_at_390_px(server, browser):
    synthetic_run(server.runs_dir, "narrow-20261201-120000-tiny-ab12", 80)
    w = open_watched(browser, viewport={"width": 390, "height": 800})
    page = w.page
    page.goto(server.base + "/")
    row = page.locator("#runs-table tr[data-run-id='narrow-20261201-120000-tiny-ab12']")
    expect(row.locator(".col-loss")).not_to_have_text("–")
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    assert page.evaluate("() => { const t = document.querySelector('.table-wrap');"
                         " return t.scrollWidth <= t.clientWidth; }")
    for col in ("col-id", "col-state", "col-progress", "col-loss"):
        box = row.locator(f".{col}").bounding_box()
        assert box and box["width"] > 0 and box["x"] >= 0 and box["x"] + box["width"] <= 390, (col, box)
    # the run's id on one line (in a column of its own it broke over four)
    assert row.locator(".col-id a").evaluate("(a) => a.getClientRects().length") == 1
    screenshot(page, "dashboard-index-390.png")
    w.context.close()
    w.check()


@pytest.fixture
def trainer():
    """The status.json fields of a running run whose trainer is a sleeping process (alive for the test):
    trainer(run_dir), the folder its command line names."""
    procs = []

    def start(run_dir):
        p, status = fake_trainer(run_dir, 120)
        procs.append(p)
        return status
    yield start
    for p in procs:
        p.kill()
        p.wait()


def first_draw(page):
    """Wait for a run page's charts to be drawn; the time from the navigation to then, and from the arrival
    of the metrics to then (the page's own part, which must stay under 2 s: the whole also counts the
    server's first read of the file, slower when the machine is loaded), both measured in the page."""
    drawn = page.wait_for_function("() => Number(document.querySelector('#chart-timing')?.dataset.points) > 0"
                                   " && performance.now()", polling=10).json_value()
    arrived = page.evaluate("() => performance.getEntriesByType('resource')"
                            ".find((e) => e.name.includes('/metrics?')).responseEnd")
    print(f"first draw: {drawn:.0f} ms after the navigation, {drawn - arrived:.0f} ms after the metrics arrived")
    assert drawn - arrived < 2000, (drawn, arrived)
    return drawn


def spiky_loss(step):
    """losses between 2 and 7 (a fixed pattern) but for one spike of 15.0 at step 50,017 (issue 36)"""
    return 15.0 if step == 50_017 else 2 + 5 * (step * 7919 % 1000) / 1000


def test_a_spike_is_drawn_in_a_100k_row_run_and_in_its_zoomed_range(server, watched):
    """Issue 36 §1: the spike is among the loss chart's drawn points at full view (the y scale reaching it),
    and after a drag-zoom to steps 49,000-51,000 the chart draws every step there, the spike included."""
    synthetic_run(server.runs_dir, "spiky", 100_000, loss=spiky_loss)
    page = watched.page
    page.goto(f"{server.base}/runs/spiky")
    first_draw(page)
    drawn = "() => { const p = window.anectypesPage.cLoss.plot; return [p.data[0], p.data[1], p.scales.x, p.scales.y]; }"
    xs, ys, _, y = page.evaluate(drawn)
    assert len(xs) <= 2000 and dict(zip(xs, ys))[50_017] == 15.0 and y["max"] >= 15.0
    assert all(v == spiky_loss(x) for x, v in zip(xs, ys))                      # each at its own step
    # the validation dots drawn (the series' points filter) at least 8 px apart, fewer than its points
    dots = page.evaluate("() => { const p = window.anectypesPage.cLoss.plot, f = p.series[3].points.filter;"
                         " const kept = f && f(p, 3, true); return kept && kept.map((i) => p.valToPos(p.data[0][i], 'x')); }")
    val_points = attr_number(page, "#chart-loss", "data-val-points")
    assert dots and all(b - a >= 8 for a, b in zip(dots, dots[1:])) and 50 < len(dots) < val_points / 2, (len(dots), val_points)

    to_px = "(v) => window.anectypesPage.cLoss.plot.valToPos(v, 'x')"
    box = page.locator("#chart-loss .u-over").bounding_box()
    mid = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + page.evaluate(to_px, 49_000), mid)
    page.mouse.down()
    page.mouse.move(box["x"] + page.evaluate(to_px, 51_000), mid, steps=8)
    page.mouse.up()
    page.wait_for_function("() => window.anectypesPage.detail !== null")
    xs, ys, x, y = page.evaluate(drawn)
    assert abs(x["min"] - 49_000) < 200 and abs(x["max"] - 51_000) < 200, x
    shown = [(s, v) for s, v in zip(xs, ys) if x["min"] <= s <= x["max"]]
    assert shown == [(s, spiky_loss(s)) for s in range(math.ceil(x["min"]), math.floor(x["max"]) + 1)]
    assert (50_017, 15.0) in shown and y["max"] >= 15.0
    page.locator("#chart-loss .u-over").dblclick()                           # the whole run again
    page.wait_for_function("() => window.anectypesPage.cLoss.plot.data[0].length <= 2000")
    watched.check()


def test_a_run_of_100k_rows_loads_in_2_s_and_stays_responsive(server, watched, trainer):
    """100,000 metric rows in a run folder the dashboard has never read: the page's load time includes the
    server's first (cold) read of metrics.jsonl, then its requests, the down-sampled metrics, nine charts
    drawn. While rows keep arriving (a live trainer, played by a sleeping process), no task blocks the
    page's main thread for 200 ms."""
    rd = synthetic_run(server.runs_dir, "big", 100_000, {**trainer(server.runs_dir / "big"), "step": 100_000, "steps": 200_000})
    page = watched.page
    page.goto(f"{server.base}/runs/big")
    first_draw(page)
    # one metrics request: the page's own fetch takes the answer its <link rel=preload> started at once
    assert sum("/metrics?" in url for url in watched.requests) == 1, watched.requests
    assert attr_number(page, "#chart-loss", "data-points") <= 2000
    expect(page.locator("#live")).to_have_attribute("data-live", "on")
    page.evaluate("() => { window.tasks = []; new PerformanceObserver((l) => window.tasks.push("
                  "...l.getEntries().map((e) => e.duration))).observe({type: 'longtask'}); }")
    with open(rd / "metrics.jsonl", "a") as f:
        for first in range(100_001, 106_001, 300):
            f.writelines(metric_lines(first, first + 299))
            f.flush()
            time.sleep(0.1)
    page.wait_for_function("() => window.anectypesPage.m.step.at(-1) === 106000", timeout=30_000)
    tasks = page.evaluate("window.tasks")                                  # main-thread tasks over 50 ms
    assert max(tasks, default=0) < 200, sorted(tasks)
    watched.check()


def test_an_mpi_runs_step_times_are_drawn_per_rank(server, watched, trainer):
    """Issue 19: the rows of a run on 2 MPI ranks carry the rank that ran them (micro-step j on rank j mod 2).
    The ms/step chart draws one series per rank, each with its own rank's rows: from the down-sampled
    first load, from live rows, and after the server down-sampled a long run's points again."""
    rd = synthetic_run(server.runs_dir, "mpi", 3000, {**trainer(server.runs_dir / "mpi"), "step": 3000, "steps": 20_000}, ranks=2)
    page = watched.page
    page.goto(f"{server.base}/runs/mpi")
    drawn = ("() => { const p = window.anectypesPage.cMs.plot; return p.series.slice(1).map((s, k) =>"
             " [s.label, p.data[0].map((x, i) => [x, p.data[k + 1][i]]).filter((xy) => xy[1] !== null)]); }")

    def per_rank():
        series = page.evaluate(drawn)
        assert [label for label, _ in series] == ["rank 0", "rank 1"]
        for rank, (_, points) in enumerate(series):
            assert all((s - 1) % 2 == rank and ms == 9 + s % 3 for s, ms in points), (rank, points)
        return [len(points) for _, points in series]

    # 1,500 rows a rank, down-sampled to share the page's 2,000 points: 1,000 at most each
    first = server.api("/api/runs/mpi/metrics?max_points=2000")["rank"]
    counts = [first.count(0), first.count(1)]
    assert 900 < min(counts) and max(counts) <= 1000, counts
    expect(page.locator("#chart-ms")).to_have_attribute("data-points", str(len(first)))
    assert per_rank() == counts
    expect(page.locator("#live")).to_have_attribute("data-live", "on")
    with open(rd / "metrics.jsonl", "a") as f:
        f.writelines(metric_lines(3001, 3010, ranks=2))
    expect(page.locator("#chart-ms")).to_have_attribute("data-points", str(len(first) + 10))
    assert per_rank() == [n + 5 for n in counts]
    with open(rd / "metrics.jsonl", "a") as f:                      # past the page's 6,000 points
        for first in range(3011, 7611, 460):
            f.writelines(metric_lines(first, first + 459, ranks=2))
            f.flush()
            time.sleep(0.1)
    page.wait_for_function("() => window.anectypesPage.cMs.plot.data[0].at(-1) === 7610"
                           " && window.anectypesPage.cMs.plot.data[0].length < 6000", timeout=30_000)
    total = attr_number(page, "#chart-ms", "data-points")
    counts = per_rank()
    assert total < 6000 and sum(counts) == total and min(counts) > 0.45 * total, (total, counts)
    watched.check()


def test_a_name_typed_before_the_run_has_loaded_is_not_overwritten(browser, tmp_path):
    # the run's own data (its meta) held back: the fields wait for it instead of taking an edit that
    # its arrival would overwrite
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    synthetic_run(runs_dir, "r-late", 20)
    srv = Server(runs_dir, tmp_path / "dashboard.log").start()
    w = open_watched(browser)
    page = w.page
    held = []
    try:
        run_url = re.compile(r".*/api/runs/r-late$")
        page.route(run_url, lambda route: held.append(route))
        page.goto(f"{srv.base}/runs/r-late")
        page.wait_for_function("() => document.querySelector('#chart-loss')?.dataset.points === '20'")
        for control in ("#meta-name", "#meta-tags", "#meta-notes", "#meta-save", "#archive-btn"):
            expect(page.locator(control)).to_be_disabled()
        assert held                                                    # (the page asks again once the run is done)
        for route in held:
            route.continue_()
        page.unroute(run_url)
        page.fill("#meta-name", "late one")                         # waits for the field to be enabled
        page.click("#meta-save")
        expect(page.locator("#meta-message")).to_have_text("saved")
        expect(page.locator("#run-id")).to_have_text("late one")
        assert srv.api("/api/runs/r-late")["meta"]["name"] == "late one"
        w.check()
    finally:
        srv.stop()


def test_name_tags_notes_survive_a_restart_sort_filter_archive_delete(browser, tmp_path):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    for name, n in (("r-short", 40), ("r-long", 160), ("r-mid", 90)):
        synthetic_run(runs_dir, name, n)
    srv = Server(runs_dir, tmp_path / "dashboard.log").start()
    w = open_watched(browser)
    page = w.page
    page.on("dialog", lambda d: d.accept())                          # the delete confirmation
    try:
        page.goto(f"{srv.base}/runs/r-long")
        expect(page.locator("#chart-loss")).to_have_attribute("data-points", "160")
        page.fill("#meta-name", "long baseline")
        page.fill("#meta-tags", "sweep-a, lr-high")
        page.fill("#meta-notes", "the one to beat")
        page.click("#meta-save")
        expect(page.locator("#meta-message")).to_have_text("saved")
        expect(page.locator("#run-id")).to_have_text("long baseline")
        srv.api("/api/runs/r-mid", {"tags": ["sweep-a"]}, method="PATCH")

        page.goto("about:blank")                                     # (no page polling the stopped server)
        srv.stop()                                                   # a dashboard restart keeps them
        srv.start()
        page.goto(f"{srv.base}/runs/r-long")
        expect(page.locator("#meta-name")).to_have_value("long baseline")
        expect(page.locator("#meta-tags")).to_have_value("sweep-a lr-high")
        expect(page.locator("#meta-notes")).to_have_value("the one to beat")
        expect(page.locator("#run-id")).to_have_text("long baseline")

        # the list: names and tags shown, sorted by a column, filtered by tag and text
        page.goto(srv.base + "/")
        ids = "() => [...document.querySelectorAll('#runs-table tbody tr')].map(tr => tr.dataset.runId)"
        page.wait_for_function(f"() => ({ids})().length === 3")
        expect(page.locator("#runs-table tr[data-run-id='r-long'] .col-id a")).to_have_text("long baseline")
        assert page.locator("#runs-table tr[data-run-id='r-long'] .tag").all_text_contents() == ["sweep-a", "lr-high"]
        page.click("#runs-table th.col-progress button")             # all finished: equal, then by loss
        page.click("#runs-table th.col-loss button")
        assert page.evaluate(ids) == ["r-long", "r-mid", "r-short"]   # lowest last loss first
        expect(page.locator("#runs-table th.col-loss")).to_have_attribute("aria-sort", "ascending")
        page.click("#runs-table th.col-loss button")
        assert page.evaluate(ids) == ["r-short", "r-mid", "r-long"]
        assert page.locator("#runs-table tr[data-run-id='r-long'] .col-duration").text_content() != "–"
        # name, tags and notes edited in the list, with the keyboard
        page.locator("#runs-table tr[data-run-id='r-short'] button.edit").focus()
        page.keyboard.press("Enter")
        expect(page.locator("#runs-table tr[data-run-id='r-short'] input.edit-name")).to_be_focused()
        page.keyboard.type("short one")
        page.keyboard.press("Tab")
        page.keyboard.type("quick")
        page.keyboard.press("Tab")
        page.keyboard.type("a short\nrun")                   # the notes: Enter is a new line there
        page.keyboard.press("Tab")                            # to Save
        page.keyboard.press("Enter")
        expect(page.locator("#runs-table tr[data-run-id='r-short'] .col-id a")).to_have_text("short one")
        assert srv.api("/api/runs/r-short")["meta"]["tags"] == ["quick"]
        assert srv.api("/api/runs/r-short")["meta"]["notes"] == "a short\nrun"
        page.select_option("#filter-tag", "sweep-a")
        assert page.evaluate(ids) == ["r-short", "r-mid", "r-long"][1:]
        page.fill("#filter-text", "beat")
        assert page.evaluate(ids) == ["r-long"]
        page.fill("#filter-text", "")
        page.select_option("#filter-tag", "")

        # compare shows the names and the meta fields
        for rid in ("r-long", "r-mid"):
            page.locator(f"#runs-table input.compare-select[value='{rid}']").check()
        page.click("#compare-btn")
        page.wait_for_selector("#compare-chart[data-series='2'] canvas")
        assert "long baseline (r-long)" in page.text_content("#compare-chart .u-legend")
        assert "long baseline (r-long)" in page.text_content("#config-diff thead")
        expect(page.locator("#config-diff tr[data-field='meta.notes'].diff")).to_contain_text("the one to beat")

        # archive hides it from the default list; delete asks, then removes the folder
        page.goto(f"{srv.base}/runs/r-short")
        page.click("#archive-btn")
        expect(page.locator("#archive-btn")).to_have_attribute("aria-pressed", "true")
        page.goto(srv.base + "/")
        page.wait_for_function(f"() => ({ids})().length === 2")
        assert "r-short" not in page.evaluate(ids)
        page.check("#show-archived")
        page.wait_for_function(f"() => ({ids})().includes('r-short')")
        expect(page.locator("#runs-table tr[data-run-id='r-short']")).to_have_class("archived")
        page.goto(f"{srv.base}/runs/r-mid")
        page.click("#delete-btn")
        page.wait_for_url(srv.base + "/")
        assert not (runs_dir / "r-mid").exists()
        page.wait_for_function(f"() => !({ids})().includes('r-mid') && ({ids})().length > 0")
        w.check()
    finally:
        w.context.close()
        srv.stop()


def test_a_2x2_sweep_is_queued_run_in_order_and_compared(browser, tmp_path):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    srv = Server(runs_dir, tmp_path / "dashboard.log", env={"PYTHONUNBUFFERED": "1"}).start()
    w = open_watched(browser)
    page = w.page
    try:
        page.goto(srv.base + "/")
        page.wait_for_selector("#start-form select[name=model] option[value=tiny]", state="attached")
        form = page.locator("#start-form")
        for name, value in (("steps", "8"), ("lr", "3e-3, 1e-3"), ("seed", "1 2"), ("sample_every", "0")):
            form.locator(f"input[name={name}]").fill(value)
        form.locator("select[name=backend]").select_option("sim")
        form.locator("select[name=precision]").select_option("fp32")
        page.click("#start-btn")
        expect(page.locator("#start-message")).to_have_text(re.compile(r"^sweep [0-9a-f]{6}: 4 runs$"))
        sweep = page.text_content("#start-message").split()[1].rstrip(":")
        assert page.input_value("#filter-tag") == f"sweep-{sweep}"
        runs = srv.api("/api/runs")["runs"]
        assert sorted(r["state"] for r in runs) == ["queued", "queued", "queued", "running"]
        assert sorted(r["position"] or 0 for r in runs) == [0, 1, 2, 3]
        # each starts when the one before it ends, in order
        for r in sorted(runs, key=lambda r: r["position"] or 0):
            srv.wait_terminal(r["id"], timeout=120)
        launched = [json.loads((runs_dir / r["id"] / "launch.json").read_text())["launched"]
                    for r in sorted(runs, key=lambda r: r["position"] or 0)]
        assert launched == sorted(launched)
        row_states = "() => [...document.querySelectorAll('#runs-table tbody .col-state')].map(e => e.textContent)"
        page.wait_for_function(f"() => ({row_states})().join() === 'finished,finished,finished,finished'")
        page.check("#select-shown")
        page.click("#compare-btn")
        page.wait_for_selector("#compare-chart[data-series='4'] canvas")
        legend = page.text_content("#compare-chart .u-legend")
        for label in ("lr=0.003 seed=1", "lr=0.003 seed=2", "lr=0.001 seed=1", "lr=0.001 seed=2"):
            assert label in legend, label
        diff = page.locator("#config-diff tbody tr.diff")
        differing = {diff.nth(i).get_attribute("data-field") for i in range(diff.count())}
        assert {"spec.lr", "spec.seed", "meta.name"} <= differing and "spec.steps" not in differing, differing
        w.check()
    finally:
        w.context.close()
        srv.stop()


# --- the keyboard (issue 20: every control keyboard reachable, with a visible focus) ------------------

# the controls of a page: what is focusable by nature or made so, and the chart legends' series names
# (a click shows or hides a series)
CONTROLS = ("a[href], button, input, select, textarea, summary, [tabindex]:not([tabindex='-1']), [role=button],"
            " .u-legend .u-series:not(:first-child) .u-label")
# records each element the focus lands on (with its outline and box shadow there); report(): the
# visible, enabled controls it never landed on, and those whose look did not change when focused
KEYBOARD = """() => {
  const look = (e) => { const s = getComputedStyle(e);
    return { ring: s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) > 0 || s.boxShadow !== 'none',
             key: [s.outlineStyle, s.outlineWidth, s.outlineColor, s.boxShadow].join(' ') }; };
  const name = (e) => e.id ? '#' + e.id : e.getAttribute('aria-label') || e.name || e.textContent.trim().slice(0, 40);
  window.kb = { looks: new Map(),
    step() {
      const e = document.activeElement;
      if (e === document.body) return 'out';
      if (this.looks.has(e)) return 'again';
      this.looks.set(e, look(e));
      return 'new';
    },
    report(selector) {
      document.activeElement.blur();
      const controls = [...document.querySelectorAll(selector)]
        .filter((e) => e.checkVisibility() && !e.disabled);
      return { reached: this.looks.size, unreached: controls.filter((e) => !this.looks.has(e)).map(name),
               no_ring: [...this.looks].filter(([e, f]) => !f.ring || f.key === look(e).key).map(([e]) => name(e)) };
    } };
}"""


def tab_walk(page):
    """Tab once round the page (from the focus, or from the top): what kb.report says."""
    page.evaluate(KEYBOARD)
    for _ in range(500):
        page.keyboard.press("Tab")
        if page.evaluate("() => kb.step()") == "again":
            return page.evaluate("(sel) => kb.report(sel)", CONTROLS)
    raise AssertionError("the focus never came round")


def tab_to(page, selector):
    """Press Tab until the focus is on `selector`."""
    for _ in range(500):
        page.keyboard.press("Tab")
        if page.evaluate("(sel) => document.activeElement.matches(sel)", selector):
            return
    raise AssertionError(f"Tab never reached {selector}")


def test_every_control_is_reached_by_tab_with_a_visible_focus(server, watched):
    for name, n in (("keys-a", 100), ("keys-b", 60)):
        synthetic_run(server.runs_dir, name, n)
    page = watched.page
    page.goto(server.base + "/")
    page.wait_for_selector("#runs-table tr[data-run-id='keys-b']")
    walk = tab_walk(page)
    assert walk["unreached"] == [] and walk["no_ring"] == [] and walk["reached"] > 20, walk

    # operated by the keyboard alone: dark mode, two runs compared, the "More options"
    tab_to(page, "#theme-toggle")
    page.keyboard.press("Enter")
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    for rid in ("keys-a", "keys-b"):
        tab_to(page, f"input.compare-select[value='{rid}']")
        page.keyboard.press("Space")
    tab_to(page, "#compare-btn")
    page.keyboard.press("Enter")
    page.wait_for_selector("#compare-chart[data-series='2'] canvas")
    tab_to(page, "#compare-x")
    page.keyboard.press("ArrowDown")
    expect(page.locator("#compare-x")).to_have_value("tokens")
    assert max(page.evaluate("() => window.anectypesPage.compareChart.data[0]")) == 100 * 64
    shown = "() => window.anectypesPage.compareChart.series.map(s => s.show)"
    tab_to(page, "#compare-chart .u-legend .u-label[role=button]")
    page.keyboard.press("Enter")                                      # the first run's curve hidden
    assert page.evaluate(shown)[1:] == [False, True, True, True]
    expect(page.locator("#compare-chart .u-label[role=button]").first).to_have_attribute("aria-pressed", "false")
    page.keyboard.press("Space")
    assert page.evaluate(shown)[1:] == [True] * 4
    tab_to(page, "details.more summary")
    page.keyboard.press("Enter")
    expect(page.locator("#start-form [name=init_from_run]")).to_be_visible()
    walk = tab_walk(page)                                             # now with the comparison, in dark
    assert walk["unreached"] == [] and walk["no_ring"] == [] and walk["reached"] > 50, walk

    page.goto(f"{server.base}/runs/keys-a")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "100")
    walk = tab_walk(page)
    assert walk["unreached"] == [] and walk["no_ring"] == [] and walk["reached"] > 50, walk
    expect(page.locator("#x-axis")).to_have_value("tokens")            # (chosen in the comparison)
    tab_to(page, "#x-axis")
    page.keyboard.press("ArrowDown")
    expect(page.locator("#x-axis")).to_have_value("time")
    assert page.evaluate("() => window.anectypesPage.cLoss.plot.data[0].at(-1)") == 99 / 2
    tab_to(page, "#chart-loss .u-label[role=button]")                  # the raw loss hidden
    page.keyboard.press("Enter")
    assert page.evaluate("() => window.anectypesPage.cLoss.plot.series.map(s => s.show)") == [True, False, True, True]
    watched.check()


def test_fine_tune_from_a_runs_checkpoint_in_the_form(server, watched):
    source = _finished_run(server)
    server.stop_runs()
    page = watched.page
    page.goto(server.base + "/")
    form = page.locator("#start-form")
    form.locator("details.more summary").click()
    form.locator(f"select[name=init_from_run] option[value='{source}']").wait_for(state="attached")
    form.locator("select[name=init_from_run]").select_option(source)
    form.locator("input[name=steps]").fill("6")
    form.locator("input[name=sample_every]").fill("0")
    form.locator("select[name=backend]").select_option("sim")
    form.locator("select[name=precision]").select_option("fp32")
    page.click("#start-btn")
    page.wait_for_url("**/runs/*")
    tuned = page.get_attribute("body", "data-run-id")
    assert tuned != source
    detail = server.wait_terminal(tuned)
    name = "best.ckpt" if "best.ckpt" in server.checkpoint_names(source) else "latest.ckpt"   # best, else latest
    checkpoint = str(server.runs_dir / source / "checkpoints" / name)
    assert detail["config"]["spec"]["init_from"] == checkpoint
    expect(page.locator("#config [data-field='spec.init_from']")).to_have_text(checkpoint)

    def first_loss(run_id):
        return server.api(f"/api/runs/{run_id}/metrics")["loss"][0]
    assert first_loss(tuned) < first_loss(source) - 0.3               # it starts from the trained weights
    watched.check()


def test_compare_follows_a_running_run(server, watched, trainer):
    """The comparison of a finished run and a running one: the running one's curve grows as its trainer
    (played by the test, appending to its metrics.jsonl) writes rows, without a reload."""
    synthetic_run(server.runs_dir, "cmp-done", 100)
    rd = synthetic_run(server.runs_dir, "cmp-live", 100, {**trainer(server.runs_dir / "cmp-live"), "step": 100, "steps": 1000})
    page = watched.page
    page.goto(server.base + "/")
    for rid in ("cmp-done", "cmp-live"):
        page.locator(f"#runs-table input.compare-select[value='{rid}']").check()
    page.click("#compare-btn")
    expect(page.locator("#compare-chart")).to_have_attribute("data-points", "200")
    page.fill("#compare-smoothing", "0")
    page.evaluate("() => { window.notReloaded = true; }")
    with open(rd / "metrics.jsonl", "a") as f:
        for first in (101, 131):
            f.writelines(metric_lines(first, first + 29))
            f.flush()
            time.sleep(0.5)
    expect(page.locator("#compare-chart")).to_have_attribute("data-points", "260", timeout=20_000)
    xs, *ys = page.evaluate("() => window.anectypesPage.compareChart.data")
    labels = page.evaluate("() => window.anectypesPage.compareChart.series.slice(1).map(s => s.label)")
    curves = {label: {x: y for x, y in zip(xs, col) if y is not None} for label, col in zip(labels, ys)}
    assert curves["cmp-live"] == pytest.approx({s: 6 / (1 + s / 100) for s in range(1, 161)})
    assert max(curves["cmp-done"]) == 100                                     # the finished run as it was
    assert page.evaluate("window.notReloaded")
    watched.check()


# --- the pages users see, for axe, the keyboard and a phone (issue 36 §9, §10) ------------------------

WIDTHS = ({"width": 1440, "height": 900}, {"width": 390, "height": 844})


def trainer_log(n):
    """n lines of a trainer's output, long enough that the log box scrolls."""
    return "".join(f"step {s:>6} | loss {6 / (1 + s / 100):.4f} | lr 1.00e-03 | 9.0 ms/step | 7000 tok/s"
                   f" | grad norm {1 + 1 / s:.3f}\n" for s in range(1, n + 1))


@pytest.fixture
def users_runs(browser, tmp_path, trainer):
    """A dashboard with the runs users have: a finished one with a long log tail, a running one, an
    archived one and a queued one (--max-running 0 keeps it queued): (the server, the queued run's id)."""
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    done = synthetic_run(runs_dir, "20261201-120000-tiny-done", 300)
    (done / "stdout.log").write_text(trainer_log(400))
    live = synthetic_run(runs_dir, "20261201-130000-tiny-live", 200,
                         {**trainer(runs_dir / "20261201-130000-tiny-live"), "step": 200, "steps": 1000})
    (live / "stdout.log").write_text(trainer_log(200))
    old = synthetic_run(runs_dir, "20261130-090000-tiny-old", 100)
    old.write_json("meta.json", {"name": "an old baseline", "archived": True, "tags": ["old"]})
    srv = Server(runs_dir, tmp_path / "dashboard.log", env={"PYTHONUNBUFFERED": "1"},
                 args=["--max-running", "0"]).start()
    queued = srv.api("/api/runs", {"model": "tiny", "steps": 10, "backend": "sim"})["id"]
    yield srv, queued
    srv.stop()


# the buttons and links whose aria-label does not hold their visible text (WCAG 2.5.3: voice control
# users say what they see; axe's own rule passes a "✎" whose name is "edit the name ...")
NAME_MISMATCH = """() => [...document.querySelectorAll('button[aria-label], a[aria-label]')]
  .filter((e) => e.checkVisibility() && !e.getAttribute('aria-label').toLowerCase().includes(e.innerText.trim().toLowerCase()))
  .map((e) => `${e.innerText.trim()}: ${e.getAttribute('aria-label')}`)"""


def axe_violations_and_names(page):
    return axe_violations(page) + [{"id": "name without its visible text", "nodes": bad}
                                   for bad in [page.evaluate(NAME_MISMATCH)] if bad]


def unfold(page):
    """Every section of a run page unfolded (on a phone they start folded)."""
    folded = page.locator("button.collapse[aria-expanded=false]")
    while folded.count():
        folded.first.click()


def axe_on_users_pages(srv, page, queued):
    """axe's serious and critical violations on each page state users see, and the controls whose name
    lacks their visible text: {state: violations}."""
    found = {}
    page.goto(f"{srv.base}/runs/20261201-120000-tiny-done")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "300")
    expect(page.locator("#logs")).to_have_attribute("data-lines", "300")
    unfold(page)
    found["finished run"] = axe_violations_and_names(page)
    page.goto(f"{srv.base}/runs/20261201-130000-tiny-live")
    expect(page.locator("#state")).to_have_text("running")
    expect(page.locator("#logs")).to_have_attribute("data-lines", "200")
    unfold(page)
    found["running run"] = axe_violations_and_names(page)
    page.goto(f"{srv.base}/runs/{queued}")
    expect(page.locator("#state")).to_have_text("queued")
    found["queued run"] = axe_violations_and_names(page)
    page.goto(srv.base + "/")
    page.check("#show-archived")
    expect(page.locator("#runs-table tr[data-run-id='20261130-090000-tiny-old']")).to_have_class("archived")
    expect(page.locator(f"#runs-table tr[data-run-id='{queued}'] .col-progress")).to_have_text("queued, #1")
    found["list with archived and queued rows"] = axe_violations_and_names(page)
    for rid in ("20261201-120000-tiny-done", "20261130-090000-tiny-old"):
        page.locator(f"#runs-table input.compare-select[value='{rid}']").check()
    page.click("#compare-btn")
    page.wait_for_selector("#compare-chart[data-series='2'] canvas")
    found["compare"] = axe_violations_and_names(page)
    return {k: v for k, v in found.items() if v}


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_axe_finds_nothing_serious_on_the_pages_users_see(browser, users_runs, theme):
    srv, queued = users_runs
    for viewport in WIDTHS:
        w = open_watched(browser, viewport=viewport, color_scheme=theme)
        try:
            found = axe_on_users_pages(srv, w.page, queued)
            assert found == {}, (viewport["width"], found)
            w.check()
        finally:
            w.context.close()


# every control's tap target (a control in a <label>: the label, which takes its taps too) smaller than
# 24 × 24 px (WCAG 2.5.8), as "what: width × height"; links inside a sentence are exempt
SMALL_TARGETS = """(sel) => [...document.querySelectorAll(sel)].filter((e) => e.checkVisibility())
  .map((e) => [e, (e.closest('label') || e).getBoundingClientRect()])
  .filter(([e, r]) => (r.width < 24 || r.height < 24) && !(e.matches('a') && e.parentElement.matches('p, li.hint')))
  .map(([e, r]) => `${e.id ? '#' + e.id : e.getAttribute('aria-label') || e.textContent.trim().slice(0, 30)
    || e.outerHTML.slice(0, 60)}: ${Math.round(r.width)} × ${Math.round(r.height)}`)"""


def test_tap_targets_at_390_px_are_24_px(browser, users_runs):
    srv, queued = users_runs
    w = open_watched(browser, viewport=WIDTHS[1])
    page = w.page
    try:
        small = {}
        page.goto(srv.base + "/")
        page.check("#show-archived")
        expect(page.locator("#runs-table tr[data-run-id='20261130-090000-tiny-old']")).to_have_class("archived")
        page.locator("details.more summary").click()
        for rid in ("20261201-120000-tiny-done", "20261130-090000-tiny-old"):
            page.locator(f"#runs-table input.compare-select[value='{rid}']").check()
        page.click("#compare-btn")
        page.wait_for_selector("#compare-chart[data-series='2'] canvas")
        small["list and compare"] = page.evaluate(SMALL_TARGETS, CONTROLS)
        page.goto(f"{srv.base}/runs/20261201-120000-tiny-done")
        expect(page.locator("#chart-loss")).to_have_attribute("data-points", "300")
        unfold(page)
        small["run page"] = page.evaluate(SMALL_TARGETS, CONTROLS)
        assert small == {"list and compare": [], "run page": []}
        w.check()
    finally:
        w.context.close()


def tabs_to(page, selector):
    """How many presses of Tab bring the focus to `selector`."""
    for n in range(1, 500):
        page.keyboard.press("Tab")
        if page.evaluate("(sel) => document.activeElement.matches(sel)", selector):
            return n
    raise AssertionError(f"Tab never reached {selector}")


def test_skip_links_and_the_focus_after_stop_and_compare(browser, users_runs):
    srv, queued = users_runs
    w = open_watched(browser)
    page = w.page
    try:
        page.goto(srv.base + "/")
        page.wait_for_selector(f"#runs-table tr[data-run-id='{queued}']")
        # the first Tab shows "Skip to content"; the second, a way past the list to the start form
        page.keyboard.press("Tab")
        expect(page.locator(".skip-link").first).to_be_focused()
        box = page.locator(".skip-link").first.bounding_box()
        assert box["y"] >= 0 and box["height"] >= 24, box
        page.keyboard.press("Tab")
        expect(page.get_by_role("link", name="Skip to Start a run")).to_be_focused()
        page.keyboard.press("Enter")
        assert tabs_to(page, "#start-btn") <= 16                # (through the form's fields, not the runs)
        page.goto(srv.base + "/")
        page.wait_for_selector(f"#runs-table tr[data-run-id='{queued}']")
        page.keyboard.press("Tab")
        page.keyboard.press("Enter")                              # skip to content: the runs list
        assert tabs_to(page, "#filter-text") == 1                 # (Compare is disabled: nothing selected)

        # Compare, by the keyboard: the focus goes to the comparison, whose controls come next
        for rid in ("20261201-120000-tiny-done", "20261201-130000-tiny-live"):
            tab_to(page, f"input.compare-select[value='{rid}']")
            page.keyboard.press("Space")
        page.locator("#compare-btn").focus()
        page.keyboard.press("Enter")
        page.wait_for_selector("#compare-chart[data-series='2'] canvas")
        expect(page.locator("#compare-section h2")).to_be_focused()
        page.keyboard.press("Tab")
        expect(page.locator("#compare-metric")).to_be_focused()
        page.locator("#compare-section details.chart-values summary").click()     # its values, as a table
        values = page.locator("#compare-section details.chart-values tbody tr")
        expect(values).to_have_count(4)                                   # each run's loss and validation
        last = values.filter(has=page.locator("th:text-is('20261201-120000-tiny-done')")).locator("td").nth(1)
        assert last.text_content().endswith(" at 300")                   # (its last step)

        # Stop (and Cancel for a queued run), by the keyboard: the focus goes to the state it changes; Delete
        # is disabled while the run runs (the server refuses it)
        for rid, button, ended in (("20261201-130000-tiny-live", "Stop", "stopped"), (queued, "Cancel", "cancelled")):
            page.goto(f"{srv.base}/runs/{rid}")
            expect(page.locator("#stop-btn")).to_have_text(button)
            expect(page.locator("#stop-btn")).to_be_enabled()
            # (the page's own "Stop" is there before the status comes: wait for Delete's state, set with it)
            delete = expect(page.locator("#delete-btn"))
            delete.to_be_disabled() if button == "Stop" else delete.to_be_enabled()
            page.locator("#stop-btn").focus()
            page.keyboard.press("Enter")
            expect(page.locator("#state")).to_be_focused()
            expect(page.locator("#state")).to_have_text(ended)
            expect(page.locator("#delete-btn")).to_be_enabled()
        # a cancelled run is queued again
        expect(page.locator("#resume-btn")).to_have_text("Queue again")
        page.locator("#resume-btn").focus()
        page.keyboard.press("Enter")
        expect(page.locator("#state")).to_have_text("queued")
        expect(page.locator("#state")).to_be_focused()
        expect(page.locator("#run-message")).to_have_text("Queued, #1: it starts when a running run ends.")
        expect(page.locator("#stop-btn")).to_have_text("Cancel")
        assert srv.api(f"/api/runs/{queued}")["status"]["position"] == 1
        w.check()
    finally:
        w.context.close()


def test_a_charts_values_are_read_from_the_keyboard(server, watched):
    """Under each chart, "Values" (a disclosure) opens a table of each series' first, last, lowest and
    highest value and where each is: a spike the canvas shows to the eye only is read out too."""
    rd = synthetic_run(server.runs_dir, "values", 300)
    rows = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if row["step"] == 150 and "loss" in row:
            row["loss"] = 15.0                                            # the spike
    (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = watched.page
    page.goto(f"{server.base}/runs/values")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "300")
    tab_to(page, ".chart-card:has(#chart-loss) details.chart-values summary")
    expect(page.locator(":focus")).to_have_accessible_name("Values of Loss")
    page.keyboard.press("Enter")
    table = page.locator(".chart-card:has(#chart-loss) details.chart-values table")
    expect(table.locator("caption")).to_have_text("300 points, step 1 to 300")

    def row(table, label):
        return table.locator("tbody tr", has=page.locator(f"th:text-is('{label}')")).locator("td").all_text_contents()
    assert row(table, "raw") == [f"{6 / 1.01:.4g} at 1", "1.5 at 300", "1.5 at 300", "15 at 150"]
    val = {s: 6 / (1 + s / 90) for s in range(50, 301, 50)}
    assert row(table, "validation") == [f"{val[50]:.4g} at 50", f"{val[300]:.4g} at 300", f"{val[300]:.4g} at 300",
                                        f"{val[50]:.4g} at 50"]
    # the step timing's table gives each component's own time, not the stacked top
    tab_to(page, ".chart-card:has(#chart-timing) details.chart-values summary")
    page.keyboard.press("Enter")
    timing = page.locator(".chart-card:has(#chart-timing) details.chart-values table")
    expect(timing.locator("caption")).to_have_text("300 points, step 1 to 300")
    assert row(timing, "dW wait") == ["0.25 ms at 1", "0.25 ms at 300", "0.25 ms at 1", "0.25 ms at 1"]   # (top: 8.75)
    # the x axis chosen is the tables' too
    page.select_option("#x-axis", "time")
    expect(table.locator("caption")).to_have_text("300 points, wall time 0 s to 2m30s")
    assert row(table, "raw")[3] == "15 at 1m15s"
    page.select_option("#x-axis", "step")
    watched.check()


def test_a_run_on_a_phone_folded_sections_and_zoom_presets(server, browser):
    """At 390 px every card but the loss's starts folded to its heading (the page was 6,490 px tall), a
    tap unfolds one with its chart drawn to the card's width; the zoom presets zoom every chart to the
    last part of the run (a drag on a phone scrolls). At 1440 px nothing is folded."""
    synthetic_run(server.runs_dir, "phone", 300)
    w = open_watched(browser, viewport=WIDTHS[1])
    page = w.page
    page.goto(f"{server.base}/runs/phone")
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "300")
    folds = page.locator("main .card-head h2 button.collapse")
    expanded = [b.get_attribute("aria-expanded") for b in folds.all()]
    assert expanded[0] == "true" and set(expanded[1:]) == {"false"} and len(expanded) >= 14, expanded
    expect(page.locator("#chart-lr")).to_be_hidden()
    expect(page.locator("#logs")).to_be_hidden()
    assert page.evaluate("() => document.documentElement.scrollHeight") < 2400
    page.get_by_role("button", name="Learning rate", exact=True).click()
    expect(page.locator("#chart-lr canvas")).to_be_visible()
    card = page.locator(".chart-card:has(#chart-lr)").bounding_box()
    canvas = page.locator("#chart-lr canvas").first.bounding_box()
    assert card["x"] <= canvas["x"] and canvas["x"] + canvas["width"] <= card["x"] + card["width"], (card, canvas)
    page.get_by_role("button", name="Logs", exact=True).click()
    expect(page.locator("#logs")).to_be_visible()
    page.get_by_role("button", name="Logs", exact=True).click()
    expect(page.locator("#logs")).to_be_hidden()
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390

    x_scales = "() => window.anectypesPage.charts.map(c => [c.plot.scales.x.min, c.plot.scales.x.max])"
    page.get_by_role("button", name="last 10%").click()
    expect(page.get_by_role("button", name="last 10%")).to_have_attribute("aria-pressed", "true")
    expect(page.get_by_role("button", name="all", exact=True)).to_have_attribute("aria-pressed", "false")
    for scale in page.evaluate(x_scales):
        assert scale == pytest.approx([300 - 0.1 * 299, 300]), scale
    page.get_by_role("button", name="last half").click()
    for scale in page.evaluate(x_scales):
        assert scale == pytest.approx([300 - 0.5 * 299, 300]), scale
    page.get_by_role("button", name="all", exact=True).click()
    for scale in page.evaluate(x_scales):
        assert scale == pytest.approx([1, 300]), scale
    expect(page.get_by_role("button", name="last half")).to_have_attribute("aria-pressed", "false")
    screenshot(page, "dashboard-run-390.png", full_page=True)
    w.context.close()
    w.check()

    w = open_watched(browser, viewport=WIDTHS[0])
    w.page.goto(f"{server.base}/runs/phone")
    expect(w.page.locator("#chart-loss")).to_have_attribute("data-points", "300")
    assert {b.get_attribute("aria-expanded") for b in w.page.locator("button.collapse").all()} == {"true"}
    w.context.close()
    w.check()


SCREENSHOTS = REPO / "web" / "static"      # the pictures of README.md and docs/dashboard.md


def png_size(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_docs_screenshots_are_this_pages(server, browser):
    """The run page of a real training run, light and dark at 1200 × 860 and on a phone, as the docs show
    it: taken here into test-artifacts/, and (with ANECTYPES_SCREENSHOTS=1) over the docs' pictures in
    web/static/, whose sizes they must keep."""
    run_id = _finished_run(server)
    server.api(f"/api/runs/{run_id}", {"name": "tiny baseline"}, method="PATCH")
    shots = {}
    for name, options in (("screenshot-run.png", {"color_scheme": "light"}),
                          ("screenshot-run-dark.png", {"color_scheme": "dark"}),
                          ("screenshot-run-390.png", {"color_scheme": "light", "viewport": {"width": 390, "height": 844}})):
        w = open_watched(browser, **{"viewport": {"width": 1200, "height": 860}, **options})
        page = w.page
        page.goto(f"{server.base}/runs/{run_id}")
        expect(page.locator("#state")).to_have_text("finished")
        expect(page.locator("#run-id")).to_have_text("tiny baseline")
        page.wait_for_selector("#samples .sample", state="attached")
        page.select_option("#x-axis", "tokens")
        wait_attr_above(page, "#chart-loss", "data-points", 100)
        if "viewport" not in options:                                     # the tooltip, over the middle
            box = page.locator("#chart-loss .u-over").bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.6)
            page.mouse.move(box["x"] + box["width"] * 0.55, box["y"] + box["height"] * 0.6, steps=3)
            expect(page.locator("#chart-loss .chart-tip")).to_be_visible()
        shots[name] = page.screenshot()
        screenshot(page, name)
        w.context.close()
        w.check()
    for name, data in shots.items():
        if os.environ.get("ANECTYPES_SCREENSHOTS") == "1":
            (SCREENSHOTS / name).write_bytes(data)
        assert png_size(data) == png_size((SCREENSHOTS / name).read_bytes()), name


def test_the_run_header_says_when_it_started_how_long_it_ran_and_will_run(browser, users_runs):
    """Start time (its first row's), elapsed, ETA (while it runs: its remaining steps at the pace of its
    last rows) and the loss smoothed as the chart draws it."""
    srv, _ = users_runs
    w = open_watched(browser)
    page = w.page
    try:
        page.goto(f"{srv.base}/runs/20261201-120000-tiny-done")
        expect(page.locator("#chart-loss")).to_have_attribute("data-points", "300")
        started = datetime.datetime.fromtimestamp(T0 + 0.5, datetime.timezone.utc)
        expect(page.locator("#stat-started")).to_have_attribute(
            "datetime", started.strftime("%Y-%m-%dT%H:%M:%S.") + "500Z")
        expect(page.locator("#stat-elapsed")).to_have_text("2m30s")             # steps 1 to 300, 0.5 s apart
        expect(page.locator("#stat-eta")).to_have_text("–")                     # finished
        smoothed = ref_smooth([6 / (1 + s / 100) for s in range(1, 301)], 0.6)[-1]
        expect(page.locator("#stat-smoothed")).to_have_text(f"{smoothed:.4g}")
        page.fill("#smoothing", "0")
        expect(page.locator("#stat-smoothed")).to_have_text("1.5")

        page.goto(f"{srv.base}/runs/20261201-130000-tiny-live")
        expect(page.locator("#state")).to_have_text("running")
        expect(page.locator("#stat-eta")).to_have_text("6m40s")                 # 800 steps to go, 0.5 s each
        w.check()
    finally:
        w.context.close()
