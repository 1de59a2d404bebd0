"""A small PromQL evaluator over scraped samples: the subset the shipped dashboard uses.

Tests scrape a real agent's ``/metrics`` a few times (``Scrapes.scrape``), label each
sample as Prometheus would (``instance``, ``job``), and evaluate every panel's query at
the last scrape (``evaluate``). Supported: instant selectors with label matchers
(``=``, ``!=``, ``=~``, ``!~``), range selectors ``[5m]`` under ``rate``/``irate``/
``increase``, ``histogram_quantile``, ``time()``, ``sum``/``max``/``min``/``avg``/
``count`` with ``by (...)``, the binary operators ``+ - * /`` between scalars and vectors,
and vector matching with ``on(...)``/``ignoring(...)`` and ``group_left``/``group_right``.
Anything else is a ``PromQLError``, never a guess: a query this cannot read fails the test
rather than passing as "no data". Rates are the plain slope between the first and last
sample of the window (no extrapolation): the tests ask "is there a series", not for
Prometheus' exact numbers.
"""

from __future__ import annotations

import math
import re
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


class PromQLError(Exception):
    """The query uses something outside the supported subset, or is malformed."""


@dataclass
class Scrapes:
    """Samples of every series seen, by labels (``__name__`` included), in scrape order."""

    series: dict[Labels, list[tuple[float, float]]] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)

    def add_text(self, text: str, at: float, target_labels: dict[str, str]) -> None:
        """Record one scrape's exposition text, taken at Unix time ``at``."""
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = {**s.labels, **target_labels, "__name__": s.name}
                self.series.setdefault(frozenset(labels.items()), []).append((at, float(s.value)))
        self.times.append(at)

    def scrape(self, url: str, target_labels: dict[str, str], timeout_s: float = 5.0) -> str:
        """GET ``url`` and record it; returns the text."""
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode()
        self.add_text(text, time.time(), target_labels)
        return text


@dataclass(frozen=True)
class Sample:
    labels: Labels
    value: float

    def get(self, name: str) -> str:
        return dict(self.labels).get(name, "")


Vector = list[Sample]
RangeVector = list[tuple[Labels, list[tuple[float, float]]]]
Value = float | Vector | RangeVector

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<dur>\[\s*\d+(?:ms|s|m|h|d|w|y)\s*\])
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|[-+*/=(){},])
""", re.VERBOSE)
_DURATION_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
AGGREGATIONS = ("sum", "max", "min", "avg", "count")
RANGE_FUNCTIONS = ("rate", "irate", "increase")


def tokenize(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            out.append((kind, m.group()))
    return out


def duration_s(text: str) -> float:
    m = re.fullmatch(r"\[\s*(\d+)(ms|s|m|h|d|w|y)\s*\]", text)
    if m is None:
        raise PromQLError(f"bad duration {text!r}")
    return int(m.group(1)) * _DURATION_S[m.group(2)]


class _Parser:
    """Recursive descent over the tokens; evaluates as it parses (one instant: ``at``)."""

    def __init__(self, expr: str, data: Scrapes, at: float) -> None:
        self.expr, self.tokens, self.pos = expr, tokenize(expr), 0
        self.data, self.at = data, at

    # -- tokens --------------------------------------------------------------------
    def peek(self, offset: int = 0) -> tuple[str, str]:
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else ("end", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        k, v = self.peek()
        if (value is not None and v != value) or (kind is not None and k != kind):
            raise PromQLError(f"expected {value or kind!r}, got {v!r} in {self.expr!r}")
        self.pos += 1
        return v

    def label_list(self) -> list[str]:
        self.take("(")
        names: list[str] = []
        while self.peek()[1] != ")":
            names.append(self.take(kind="ident"))
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return names

    # -- grammar -------------------------------------------------------------------
    def parse(self) -> Value:
        value = self.additive()
        if self.peek()[0] != "end":
            raise PromQLError(f"unexpected {self.peek()[1]!r} in {self.expr!r}")
        return value

    def additive(self) -> Value:
        left = self.multiplicative()
        while self.peek()[1] in ("+", "-"):
            op = self.take()
            matching = self.matching()
            left = binary(op, left, self.multiplicative(), matching)
        return left

    def multiplicative(self) -> Value:
        left = self.primary()
        while self.peek()[1] in ("*", "/"):
            op = self.take()
            matching = self.matching()
            left = binary(op, left, self.primary(), matching)
        return left

    def matching(self) -> _Matching | None:
        k, v = self.peek()
        if k != "ident" or v not in ("on", "ignoring"):
            return None
        self.take()
        m = _Matching(on=v == "on", labels=self.label_list())
        k, v = self.peek()
        if k == "ident" and v in ("group_left", "group_right"):
            self.take()
            m.group = v
            if self.peek()[1] == "(":
                m.include = self.label_list()
        return m

    def primary(self) -> Value:
        k, v = self.peek()
        if k == "num":
            self.take()
            return float(v)
        if v == "(":
            self.take("(")
            inner = self.additive()
            self.take(")")
            return inner
        if k != "ident":
            raise PromQLError(f"unexpected {v!r} in {self.expr!r}")
        if v in AGGREGATIONS:
            return self.aggregation()
        if self.peek(1)[1] == "(" and v in (*RANGE_FUNCTIONS, "histogram_quantile", "time"):
            return self.function()
        if self.peek(1)[1] == "(":
            raise PromQLError(f"function {v!r} is not supported (in {self.expr!r})")
        return self.selector()

    def aggregation(self) -> Vector:
        op = self.take()
        by: list[str] | None = None
        if self.peek()[1] == "by":
            self.take()
            by = self.label_list()
        self.take("(")
        inner = self.additive()
        self.take(")")
        if self.peek()[1] == "by":
            self.take()
            by = self.label_list()
        if self.peek()[1] == "without":
            raise PromQLError("'without' is not supported")
        return aggregate(op, as_vector(inner, self.expr), by or [])

    def function(self) -> Value:
        name = self.take()
        self.take("(")
        if name == "time":
            self.take(")")
            return self.at
        if name == "histogram_quantile":
            q = self.additive()
            self.take(",")
            v = self.additive()
            self.take(")")
            if not isinstance(q, float):
                raise PromQLError("histogram_quantile's first argument must be a scalar")
            return histogram_quantile(q, as_vector(v, self.expr))
        arg = self.selector(allow_range=True)
        self.take(")")
        if not (isinstance(arg, list) and (not arg or isinstance(arg[0], tuple))):
            raise PromQLError(f"{name}() needs a range selector, in {self.expr!r}")
        return range_function(name, arg)  # type: ignore[arg-type]

    def selector(self, allow_range: bool = False) -> Value:
        name = self.take(kind="ident")
        matchers: list[tuple[str, str, str]] = [("__name__", "=", name)]
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label = self.take(kind="ident")
                op = self.take()
                if op not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"bad matcher operator {op!r} in {self.expr!r}")
                raw = self.take(kind="str")
                matchers.append((label, op, raw[1:-1].encode().decode("unicode_escape")))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        window: float | None = None
        if self.peek()[0] == "dur":
            if not allow_range:
                raise PromQLError(f"a range selector outside rate/irate/increase in {self.expr!r}")
            window = duration_s(self.take())
        selected = [(labels, pts) for labels, pts in self.data.series.items()
                    if all(_match(dict(labels).get(lbl, ""), op, val) for lbl, op, val in matchers)]
        if window is None:
            # An instant vector: each series' newest sample at ``at`` (a series last seen
            # more than 5 minutes ago is stale, as in Prometheus).
            out: Vector = []
            for labels, pts in selected:
                recent = [(t, v) for t, v in pts if self.at - 300 < t <= self.at]
                if recent:
                    out.append(Sample(labels, recent[-1][1]))
            return out
        ranged = [(labels, [(t, v) for t, v in pts if self.at - window < t <= self.at])
                  for labels, pts in selected]
        return [(labels, pts) for labels, pts in ranged if pts]


@dataclass
class _Matching:
    on: bool
    labels: list[str]
    group: str | None = None
    include: list[str] = field(default_factory=list)


def _match(value: str, op: str, want: str) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    hit = re.fullmatch(want, value) is not None
    return hit if op == "=~" else not hit


def _drop_name(labels: Labels) -> Labels:
    return frozenset((k, v) for k, v in labels if k != "__name__")


def as_vector(value: Value, expr: str) -> Vector:
    if isinstance(value, float) or (value and isinstance(value[0], tuple)):
        raise PromQLError(f"expected an instant vector in {expr!r}")
    return value  # type: ignore[return-value]


def _apply(op: str, a: float, b: float) -> float:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        return math.nan if a == 0 else math.copysign(math.inf, a)
    return a / b


def binary(op: str, left: Value, right: Value, matching: _Matching | None) -> Value:
    if isinstance(left, float) and isinstance(right, float):
        return _apply(op, left, right)
    if isinstance(left, float):
        return [Sample(_drop_name(s.labels), _apply(op, left, s.value)) for s in as_vector(right, op)]
    if isinstance(right, float):
        return [Sample(_drop_name(s.labels), _apply(op, s.value, right)) for s in as_vector(left, op)]
    lv, rv = as_vector(left, op), as_vector(right, op)

    def key(s: Sample) -> Labels:
        labels = _drop_name(s.labels)
        if matching is None:
            return labels
        if matching.on:
            return frozenset((k, v) for k, v in labels if k in matching.labels)
        return frozenset((k, v) for k, v in labels if k not in matching.labels)

    group = matching.group if matching is not None else None
    many, one = (rv, lv) if group == "group_right" else (lv, rv)
    index: dict[Labels, Sample] = {}
    for s in one:
        if key(s) in index:
            raise PromQLError(f"many-to-many matching on {sorted(key(s))} ('one' side has duplicates)")
        index[key(s)] = s
    seen: set[Labels] = set()
    out: Vector = []
    for s in many:
        other = index.get(key(s))
        if other is None:
            continue
        if group is None:
            if key(s) in seen:
                raise PromQLError(f"many-to-one matching needs group_left/right on {sorted(key(s))}")
            seen.add(key(s))
        labels = dict(_drop_name(s.labels))
        if matching is not None and group is None and matching.on:
            labels = dict(key(s))  # one-to-one with on(): the result keeps only those labels
        for name in (matching.include if matching is not None else []):
            labels[name] = other.get(name)
        a, b = (s.value, other.value) if group != "group_right" else (other.value, s.value)
        out.append(Sample(frozenset(labels.items()), _apply(op, a, b)))
    return out


def aggregate(op: str, vector: Vector, by: list[str]) -> Vector:
    groups: dict[Labels, list[float]] = {}
    for s in vector:
        key = frozenset((k, v) for k, v in s.labels if k in by)
        groups.setdefault(key, []).append(s.value)
    out: Vector = []
    for key, values in groups.items():
        if op == "sum":
            v = sum(values)
        elif op == "max":
            v = max(values)
        elif op == "min":
            v = min(values)
        elif op == "avg":
            v = sum(values) / len(values)
        else:
            v = float(len(values))
        out.append(Sample(key, v))
    return out


def range_function(name: str, ranged: RangeVector) -> Vector:
    out: Vector = []
    for labels, pts in ranged:
        if len(pts) < 2:
            continue  # as in Prometheus: a rate needs two samples in the window
        if name == "irate":
            pts = pts[-2:]
        increase = 0.0
        for (_, a), (_, b) in zip(pts, pts[1:], strict=False):
            increase += b - a if b >= a else b  # a counter reset starts from zero
        span = pts[-1][0] - pts[0][0]
        value = increase if name == "increase" else (increase / span if span > 0 else math.nan)
        out.append(Sample(_drop_name(labels), value))
    return out


def histogram_quantile(q: float, vector: Vector) -> Vector:
    """Prometheus' interpolation within the bucket that holds the q-th observation."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for s in vector:
        le = s.get("le")
        if not le:
            continue
        key = frozenset((k, v) for k, v in _drop_name(s.labels) if k != "le")
        groups.setdefault(key, []).append((float(le), s.value))
    out: Vector = []
    for key, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1]
        if not math.isinf(buckets[-1][0]) or total <= 0 or math.isnan(total):
            out.append(Sample(key, math.nan))
            continue
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        value = math.nan
        for upper, count in buckets:
            if count >= rank:
                if math.isinf(upper):
                    value = lower_bound
                elif count == lower_count:
                    value = upper
                else:
                    value = lower_bound + (upper - lower_bound) * (rank - lower_count) / (count - lower_count)
                break
            lower_bound, lower_count = upper, count
        out.append(Sample(key, value))
    return out


def evaluate(expr: str, data: Scrapes, at: float | None = None) -> Value:
    """Evaluate ``expr`` at ``at`` (default: the last scrape).

    Raises:
        PromQLError: outside the supported subset, or malformed.
    """
    when = at if at is not None else (data.times[-1] if data.times else time.time())
    return _Parser(expr, data, when).parse()


def label_values(query: str, data: Scrapes) -> list[str]:
    """Grafana's ``label_values(metric, label)`` variable query."""
    m = re.fullmatch(r"\s*label_values\(\s*([^,]+?)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*", query)
    if m is None:
        raise PromQLError(f"not a label_values(metric, label) query: {query!r}")
    selected = evaluate(m.group(1), data)
    return sorted({s.get(m.group(2)) for s in as_vector(selected, query)} - {""})
