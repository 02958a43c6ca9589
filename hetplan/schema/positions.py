"""Where a key path sits in a JSON text: the 1-based line of ``layers["3"][2]`` in a file.

A position-tracking walk over the raw text: objects and arrays are entered only along the path,
every other value is skipped with ``json.JSONDecoder.raw_decode``, which reports where it ended.
Knows JSON only; knows nothing about any one file format.
"""

from __future__ import annotations

import json
import json.decoder

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def json_line(text: str, loc: tuple) -> int | None:
    """The line of the value at ``loc`` (the key's line for an object member) in JSON ``text``,
    or None when the text is not JSON or the path leads nowhere."""
    try:
        return _line(text, loc)
    except (ValueError, IndexError, RecursionError):
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _line(text: str, loc: tuple) -> int | None:
    i = _skip_ws(text, 0)
    line = None
    for part in loc:
        if text[i] == "{":
            i = _skip_ws(text, i + 1)
            while text[i] != "}":
                key, j = json.decoder.scanstring(text, i + 1)
                at = i
                i = _skip_ws(text, j)
                if text[i] != ":":
                    return line
                i = _skip_ws(text, i + 1)
                if key == str(part):
                    line = text.count("\n", 0, at) + 1
                    break
                i = _skip_ws(text, _DECODER.raw_decode(text, i)[1])
                if text[i] == ",":
                    i = _skip_ws(text, i + 1)
            else:
                return line
        elif text[i] == "[" and isinstance(part, int):
            i = _skip_ws(text, i + 1)
            for _ in range(part):
                if text[i] == "]":
                    return line
                i = _skip_ws(text, _DECODER.raw_decode(text, i)[1])
                if text[i] == ",":
                    i = _skip_ws(text, i + 1)
            if text[i] == "]":
                return line
            line = text.count("\n", 0, i) + 1
        else:
            return line
    return line
