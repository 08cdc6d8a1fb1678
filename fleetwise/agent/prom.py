"""Parser for the Prometheus text exposition format (version 0.0.4), as dcgm-exporter serves it.

Format (prometheus.io/docs/instrumenting/exposition_formats/):

    # HELP metric_name docstring with \\\\ and \\n escapes
    # TYPE metric_name counter|gauge|histogram|summary|untyped
    metric_name{label="value",other="va\\"lue, with comma"} 1.5e3 [timestamp_ms]

Label values escape backslash, double quote and newline; a trailing comma inside the braces is
allowed; the value is a Go float (incl. NaN, +Inf, -Inf); the optional timestamp is int64
milliseconds. Any other ``#`` line is a comment. Pure functions over text: no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_LABEL_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class PromParseError(ValueError):
    """A line that is not valid exposition format; the message names the line number."""


@dataclass(frozen=True)
class PromSample:
    """One sample line: metric name, labels, value, optional timestamp (ms)."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp_ms: int | None = None


@dataclass
class PromPage:
    """A parsed /metrics page: the samples in order plus HELP and TYPE by metric name."""

    samples: list[PromSample] = field(default_factory=list)
    help: dict[str, str] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)


def parse_value(text: str) -> float:
    """A Go-style float as the exposition format writes it ("NaN", "+Inf", "-Inf", "1e3", "42")."""
    lowered = text.lower()
    if lowered in ("nan",):
        return math.nan
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    return float(text)


def _unescape_help(text: str) -> str:
    out = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in ("\\", "n"):
            out.append("\\" if text[i + 1] == "\\" else "\n")
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _parse_labels(line: str, pos: int, lineno: int) -> tuple[dict[str, str], int]:
    """Parse `{a="x",b="y"}` starting at the `{` at `pos`; returns labels and the index after `}`."""
    labels: dict[str, str] = {}
    i = pos + 1
    n = len(line)
    while True:
        while i < n and line[i] in " \t":
            i += 1
        if i < n and line[i] == "}":
            return labels, i + 1
        m = _LABEL_NAME.match(line, i)
        if not m:
            raise PromParseError(f"line {lineno}: expected a label name at column {i + 1}: {line!r}")
        name = m.group(0)
        i = m.end()
        while i < n and line[i] in " \t":
            i += 1
        if i >= n or line[i] != "=":
            raise PromParseError(f"line {lineno}: expected '=' after label {name!r}: {line!r}")
        i += 1
        while i < n and line[i] in " \t":
            i += 1
        if i >= n or line[i] != '"':
            raise PromParseError(f"line {lineno}: label {name!r} value must be double-quoted: {line!r}")
        i += 1
        chars: list[str] = []
        while True:
            if i >= n:
                raise PromParseError(f"line {lineno}: unterminated value of label {name!r}: {line!r}")
            ch = line[i]
            if ch == "\\":
                if i + 1 >= n:
                    raise PromParseError(f"line {lineno}: dangling backslash in label {name!r}")
                nxt = line[i + 1]
                # Unknown escapes are kept verbatim, as the Prometheus parser does.
                chars.append(_LABEL_ESCAPES.get(nxt, "\\" + nxt))
                i += 2
                continue
            if ch == '"':
                i += 1
                break
            chars.append(ch)
            i += 1
        if name in labels:
            raise PromParseError(f"line {lineno}: duplicate label {name!r}: {line!r}")
        labels[name] = "".join(chars)
        while i < n and line[i] in " \t":
            i += 1
        if i < n and line[i] == ",":
            i += 1
            continue
        if i < n and line[i] == "}":
            return labels, i + 1
        raise PromParseError(f"line {lineno}: expected ',' or '}}' after label {name!r}: {line!r}")


def parse_sample_line(line: str, lineno: int = 0) -> PromSample:
    """Parse one sample line (not a comment)."""
    m = _NAME.match(line)
    if not m:
        raise PromParseError(f"line {lineno}: expected a metric name: {line!r}")
    name = m.group(0)
    i = m.end()
    labels: dict[str, str] = {}
    if i < len(line) and line[i] == "{":
        labels, i = _parse_labels(line, i, lineno)
    rest = line[i:].split()
    if not rest or len(rest) > 2:
        raise PromParseError(f"line {lineno}: expected 'value [timestamp]' after {name}: {line!r}")
    try:
        value = parse_value(rest[0])
    except ValueError:
        raise PromParseError(f"line {lineno}: value {rest[0]!r} of {name} is not a number") from None
    ts_ms: int | None = None
    if len(rest) == 2:
        try:
            ts_ms = int(rest[1])
        except ValueError:
            raise PromParseError(
                f"line {lineno}: timestamp {rest[1]!r} of {name} is not an integer"
            ) from None
    return PromSample(name, labels, value, ts_ms)


def parse_exposition(text: str) -> PromPage:
    """Parse a whole page. Raises PromParseError on the first malformed line."""
    page = PromPage()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line[1:].strip().split(None, 2)
            if len(parts) >= 2 and parts[0] in ("HELP", "TYPE"):
                name = parts[1]
                rest = parts[2] if len(parts) > 2 else ""
                if parts[0] == "HELP":
                    page.help[name] = _unescape_help(rest)
                else:
                    page.types[name] = rest.strip().lower() or "untyped"
            continue
        page.samples.append(parse_sample_line(line, lineno))
    return page
