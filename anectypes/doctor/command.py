"""The doctor's command line: flags, then the ladder as text rows (printed as each probe ends), JSON or a
Markdown report. Exit status 1 when a probe failed, 0 otherwise."""

import json
import os
import re
import shlex
import sys
from collections import Counter

from .. import __version__
from ..cli import ArgumentParser, at_least, quiet_on_closed_stdout
from ..device import add_dialect_flag
from ..device.ane import DIALECT_VARIABLE
from ..errors import AnectypesError
from ..model.config import PRESETS, load_config
from .ladder import ladder

STATUSES = ("OK", "FAIL", "SKIP")


def text_row(row):
    lines = [f"{row['probe']:<18} {row['status']:<4} {row['seconds']:7.2f} s  {row['summary']}"]
    if row["error"]:
        error = row["error"].splitlines()
        lines += ["    " + line for line in (error[1:] if error[0] == row["summary"] else error)]
    return "\n".join(lines)


def counts(rows):
    found = Counter(r["status"] for r in rows)
    return {s: found[s] for s in STATUSES}


def document(rows, args, argv):
    command = shlex.join(["python", "-m", "anectypes.doctor", *argv])
    return dict(schema_version=1, anectypes=__version__, command=command, model=args.model, reps=args.reps,
                counts=counts(rows), rows=rows)


def fenced(text, info=""):
    """A code block around `text`, its fence longer than any run of backticks inside."""
    fence = "`" * max([3, *(len(run) + 1 for run in re.findall("`+", text))])
    return f"{fence}{info}\n{text}\n{fence}"


def cell(text):
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(doc):
    """The report a user pastes into an issue: the table, each failure's full error, then the whole ladder as JSON."""
    c = doc["counts"]
    out = [f"### anectypes doctor: {c['FAIL']} FAIL, {c['OK']} OK, {c['SKIP']} SKIP", "",
           f"`{doc['command']}`, anectypes {doc['anectypes']}", "",
           "| probe | status | time | result |", "| --- | --- | --- | --- |"]
    out += [f"| {r['probe']} | {r['status']} | {r['seconds']:.2f} s | {cell(r['summary'])} |" for r in doc["rows"]]
    for r in doc["rows"]:
        if r["status"] == "FAIL":
            out += ["", f"#### FAIL: {r['probe']}", "", fenced(r["error"])]
    out += live_io(doc["rows"])
    out += ["", "<details><summary>The whole ladder as JSON</summary>", "", fenced(json.dumps(doc, indent=1), "json"),
            "", "</details>"]
    return "\n".join(out)


def live_io(rows):
    """The engine's live I/O list of each program, as its probe read it (ane-reference.md §1.6): a table."""
    lists = [(r["probe"], what, e) for r in rows if (r["facts"].get("live_io") or {})
             for what in ("inputs", "outputs") for e in r["facts"]["live_io"][what]]
    if not lists:
        return []
    keys = [k for k in lists[0][2] if k != "Symbol"]
    return ["", "#### The engine's live I/O lists", "", "| probe | list | Symbol | " + " | ".join(keys) + " |",
            "|---" * (len(keys) + 3) + "|"] + [f"| {p} | {what} | {cell(e['Symbol'])} | " +
                                                " | ".join(str(e[k]) for k in keys) + " |" for p, what, e in lists]


@quiet_on_closed_stdout
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = ArgumentParser(prog="python -m anectypes.doctor", description="A ladder of probes, each in a process of "
                        "its own, that pinpoints what fails on this machine (docs/doctor.md).")
    shown = ap.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="the ladder as one JSON object (tools/doctor_schema.json)")
    shown.add_argument("--report", action="store_true", help="the ladder as Markdown, to paste into a bug report")
    ap.add_argument("--model", default="tiny", help=f"whose ten training kernels to check: a preset "
                                                    f"({', '.join(PRESETS)}) or a JSON config (default tiny)")
    ap.add_argument("--reps", type=at_least(1), default=50, help="evaluations timed of the trivial program, the "
                                                                 "control and the BLAS (default 50)")
    ap.add_argument("--timeout", type=at_least(1), default=600, help="seconds a probe may take before it is "
                                                                     "stopped and reported as hung (default 600)")
    add_dialect_flag(ap)
    args = ap.parse_args(argv)
    if args.dialect:                    # the probes' processes choose it as the trainer's do (docs/ane-backend.md)
        os.environ[DIALECT_VARIABLE] = args.dialect
    try:
        load_config(args.model)
    except AnectypesError as e:
        ap.error(f"--model: {e}")
    each = None if args.json or args.report else lambda row: print(text_row(row), flush=True)
    rows = ladder(dict(model=args.model, reps=args.reps), args.timeout, each)
    doc = document(rows, args, argv)
    if args.json:
        print(json.dumps(doc))
    elif args.report:
        print(markdown(doc))
    else:
        c = doc["counts"]
        print(f"{len(rows)} probes: {c['OK']} OK, {c['FAIL']} FAIL, {c['SKIP']} SKIP"
              + ("; --report prints all of it for a bug report" if c["FAIL"] else ""))
    return 1 if doc["counts"]["FAIL"] else 0
