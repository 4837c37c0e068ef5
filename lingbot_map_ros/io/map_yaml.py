"""The YAML subset of map_server's map files, without a YAML library.

map.yaml files (ours, map_saver's, hand-written ones) are flat ``key: value`` lines;
``parse_map_yaml`` reads exactly that subset and refuses the rest with the line number,
``yaml_float`` writes floats that every YAML reader takes as floats.
"""
from __future__ import annotations

import re

__all__ = ["MapFilesError", "parse_map_yaml", "yaml_float"]


class MapFilesError(ValueError):
    """Map files cannot be written or read; the message is a one-line reason."""


_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:(?:\s+(.*))?$")
_INT = re.compile(r"^[-+]?(0|[1-9][0-9]*)$")
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def parse_map_yaml(text: str) -> dict:
    """Parse the YAML subset of map files: one ``key: value`` per line at column 0.

    Values: a flow list ``[a, b, c]`` of scalars, a quoted string (``'..'`` or ``".."``), or a
    plain scalar: integer, float, boolean (true/false/yes/no/on/off), else a string.
    Comments (``#`` at a line start or after a space) and ``---`` / ``...`` are skipped.

    Raises:
        MapFilesError: anything else (nesting, block lists, multi-line values, duplicate keys),
            naming the line.
    """
    out: dict = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _strip_comment(raw).rstrip()
        if not line.strip() or line.strip() in ("---", "..."):
            continue
        match = _KEY.match(line)
        if not match:
            raise MapFilesError(f"line {number}: not a 'key: value' line of a map file: {raw.strip()!r}")
        key, value = match.group(1), (match.group(2) or "").strip()
        if key in out:
            raise MapFilesError(f"line {number}: duplicate key '{key}'")
        if not value:
            raise MapFilesError(f"line {number}: '{key}' has no value on its line (nested values are not supported)")
        if value.startswith("["):
            if not value.endswith("]"):
                raise MapFilesError(f"line {number}: unterminated list for '{key}'")
            inner = value[1:-1].strip()
            out[key] = [_scalar(item.strip(), number) for item in inner.split(",")] if inner else []
        else:
            out[key] = _scalar(value, number)
    return out


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment that is outside quotes."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1] in " \t"):
            return line[:k]
    return line


def _scalar(text: str, number: int):
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        body = text[1:-1]
        return body.replace("''", "'") if text[0] == "'" else body.replace('\\"', '"').replace("\\\\", "\\")
    if not text or text[0] in "[]{}&*!|>%@`\"'" or text.startswith("- "):
        raise MapFilesError(f"line {number}: unsupported YAML value {text!r}")
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return _BOOLS.get(text.lower(), text)


def yaml_float(value: float) -> str:
    """Shortest exact decimal of ``value`` that YAML 1.1 and 1.2 readers both take as a float."""
    text = repr(float(value) + 0.0)  # + 0.0: no "-0.0"
    mantissa, _, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return f"{mantissa}e{exponent}" if exponent else mantissa
