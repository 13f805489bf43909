"""A run's metric rows as the dashboard reads and serves them: each metrics.jsonl line parsed into a tuple
(step, *METRIC_KEYS values), rows merged in step order, and down-sampled into columns for the charts."""

from __future__ import annotations

import math

import msgspec
import numpy as np
from pydantic_core import SchemaValidator, core_schema

from anectypes.runs import METRIC_KEYS

RANK = 1 + METRIC_KEYS.index("rank")       # a metric row's rank column
# the row positions down-sampling keeps the extremes of: every metric but the wall time and the rank
EXTREMES = [k for k, key in enumerate(METRIC_KEYS, 1) if key not in ("t", "rank")]


# A metrics.jsonl row: an integer step and rank, every other metric a finite number as a float (an integer
# written for one comes back as the same number, as a float), anything else None, the fields in the order of
# METRIC_KEYS. A well-formed row is decoded by msgspec (the hot path of a large run's first load: about 2.5
# times faster than pydantic-core); a row it refuses is checked field by field by pydantic-core, whose
# defaults make each bad value None (a NaN written by another tool, a string, an out-of-range number).
_ROW = msgspec.json.Decoder(msgspec.defstruct("MetricRow", [("step", int)] + [
    (key, (int if key == "rank" else float) | None, None) for key in METRIC_KEYS], gc=False))


def _metric(number):
    return core_schema.typed_dict_field(core_schema.with_default_schema(core_schema.nullable_schema(number),
                                                                        default=None, on_error="default"),
                                        required=False)


_TOLERANT_ROW = SchemaValidator(core_schema.typed_dict_schema({
    "step": core_schema.typed_dict_field(core_schema.int_schema(strict=True)),
    **{key: _metric(core_schema.int_schema(strict=True) if key == "rank" else
                    core_schema.float_schema(strict=True, allow_inf_nan=False)) for key in METRIC_KEYS}}))


def parse_metric(line):
    """A metrics.jsonl line as a tuple (step, *METRIC_KEYS values), or None when it is not a row (malformed,
    not an object, no integer step). (A tuple of numbers is soon untracked by the garbage collector, which
    would otherwise walk a large run's rows in every full collection.)"""
    try:
        return msgspec.structs.astuple(_ROW.decode(line))
    except ValueError:
        pass
    try:
        return tuple(_TOLERANT_ROW.validate_json(line).values())
    except ValueError:
        return None


def merge_rows(rows, new):
    """Append metric rows in step order: a row of the step already last (a validation row) fills in its
    values; a row of an earlier step (a file rewound under a reader) replaces the rows from there on."""
    for r in new:
        while rows and rows[-1][0] > r[0]:
            rows.pop()
        if rows and rows[-1][0] == r[0]:
            rows[-1] = tuple(a if b is None else b for a, b in zip(rows[-1], r))
        else:
            rows.append(r)
    return rows


def last_value(rows, key):
    """The last non-null value of a metric in merged rows, or None."""
    i = 1 + METRIC_KEYS.index(key)
    return next((r[i] for r in reversed(rows) if r[i] is not None), None)


def downsample_index(n, max_points):
    """Row indices after striding n rows down to at most max_points, always keeping the last one."""
    if n <= max_points:
        return list(range(n))
    stride = math.ceil(n / max_points)
    idx = list(range(0, n, stride))
    if idx[-1] != n - 1:
        if len(idx) >= max_points:
            idx[-1] = n - 1
        else:
            idx.append(n - 1)
    return idx


def extremes_index(values, buckets):
    """The sorted row indices kept of `values` (n rows by k columns, NaN where absent) split into `buckets`
    runs of consecutive rows (bucket b: rows n*b//buckets to n*(b+1)//buckets - 1): each bucket's first and
    last row and, for each column, the first row of its minimum and of its maximum (M4, column by column)."""
    n = len(values)
    edges = np.arange(buckets + 1) * n // buckets
    starts = edges[:-1]
    bucket = np.repeat(np.arange(buckets), np.diff(edges))
    keep = [starts, edges[1:] - 1]
    for col in values.T:
        for reduce in (np.fmin, np.fmax):
            hits = np.flatnonzero(col == reduce.reduceat(col, starts)[bucket])     # (NaN equals nothing)
            first = np.ones(len(hits), bool)
            first[1:] = bucket[hits[1:]] != bucket[hits[:-1]]
            keep.append(hits[first])
    return np.unique(np.concatenate(keep))


def extremes_downsample(values, max_points):
    """Row indices of `values` (as extremes_index) down to at most max_points: as many buckets as fit, each
    keeping its extremes, so that no spike is lost; strided when even one bucket's extremes do not fit."""
    n = len(values)
    if n <= max_points:
        return list(range(n))
    buckets = max_points // 2
    while buckets:
        keep = extremes_index(values, buckets)
        if len(keep) <= max_points:
            return keep.tolist()
        buckets = min(buckets - 1, buckets * max_points // len(keep))
    return downsample_index(n, max_points)


def rank_rows(rows):
    """The indices of each rank's rows (an MPI run's rows carry the rank that ran them; others have none)."""
    ranks = [row[RANK] for row in rows]
    return [[i for i, r in enumerate(ranks) if r == rank] for rank in set(ranks)]


def metric_values(rows):
    """The EXTREMES columns of metric rows as an n by len(EXTREMES) float array, NaN where absent."""
    cols = list(zip(*rows))
    return np.array([np.array(cols[k], dtype=float) for k in EXTREMES]).T.reshape(len(rows), len(EXTREMES))


def columns(rows, max_points, values=None):
    """Metric rows as down-sampled columns {"step": [...], key: [...]}, each rank's rows down-sampled apart (an
    MPI run's ranks take turns: one pass over all could keep a single rank's) by extremes_downsample, so
    each bucket's lowest and highest value of every metric is drawn, at its own step. values: the rows'
    metric_values, when known."""
    ranks = rank_rows(rows)
    share = max(1, max_points // max(1, len(ranks)))
    keep = range(len(rows))
    if any(len(rank) > share for rank in ranks):
        values = metric_values(rows) if values is None else values
        keep = sorted(rank[i] for rank in ranks for i in extremes_downsample(values[rank], share))
    return {"step": [rows[i][0] for i in keep],
            **{key: [rows[i][k] for i in keep] for k, key in enumerate(METRIC_KEYS, 1)}}
