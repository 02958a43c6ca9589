"""Reading the user's JSON files with errors that say which file, where, and what to do."""

from __future__ import annotations

import json
from pathlib import Path

from hetplan.errors import HetplanError


def read_json(path: str | Path, missing: str, fix: str = "") -> object:
    """Parse the JSON file at ``path``. ``missing`` completes "PATH: no such ..." when it does not
    exist; ``fix`` is appended to the message of a malformed file (e.g. "; re-run ...")."""
    p = Path(path)
    if not p.is_file():
        raise HetplanError(f"{p}: no such {missing}")
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise HetplanError(f"{p}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise HetplanError(f"{p}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}{fix}") from None
