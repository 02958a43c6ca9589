"""Every file hetplan reads as JSON and every file it writes goes through here.

Reading: ``read_json`` (``read_text`` then ``parse_json``) says which file, where (line:column)
and what to do.
Writing: ``write_atomic`` is the one writer (plans, traces, timelines, routing statistics,
profiles, node.yaml). It writes only regular files: a device, a directory, a FIFO or a socket at
the target is refused, never replaced; a symlink is written *through* (its target is replaced
atomically and the link stays a link). The bytes go to a temporary file in the target's directory
and are renamed over it, so a reader never sees half a file and a failure leaves the old file
as it was. An existing file keeps its mode; a new one gets ``0666 & ~umask`` (0644 usually).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import yaml

from hetplan.errors import HetplanError


def read_json(path: str | Path, missing: str, fix: str = "") -> object:
    """Parse the JSON file at ``path``. ``missing`` completes "PATH: no such ..." when it does not
    exist; ``fix`` is appended to the message of a malformed file (e.g. "; re-run ...")."""
    return parse_json(read_text(path, missing, "a JSON file", fix), path, fix)


def read_text(path: str | Path, missing: str, expected: str, fix: str = "") -> str:
    """The UTF-8 text of the file at ``path`` (``expected`` names what it should be, e.g. "a JSON
    file", for a file that is not text)."""
    p = Path(path)
    if not p.is_file():
        if p.exists():  # never open a FIFO or a device: reading one blocks or never ends
            raise HetplanError(f"{p}: is {kind_of(p.stat().st_mode)}, not a file; expected {expected}{fix}")
        raise HetplanError(f"{p}: no such {missing}")
    try:
        return p.read_bytes().decode("utf-8")
    except OSError as e:
        raise HetplanError(f"{p}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise HetplanError(f"{p}: not a text file (it is not UTF-8); expected {expected}{fix}") from None


YAML_NODES_MAX = 100_000
"""The most values a YAML file may hold once its aliases are expanded (a node.yaml holds about
fifty; nested aliases can stand for billions, which every reader after the loader would walk)."""


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses an alias bomb: a document whose aliases (``*name``)
    expand to more than ``YAML_NODES_MAX`` values."""

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None and _expanded_size(node, {}) > YAML_NODES_MAX:
            raise yaml.composer.ComposerError(None, None, f"its aliases (*name) expand to more than "
                                              f"{YAML_NODES_MAX} values; write the values out", node.start_mark)
        return node


def _expanded_size(node, memo: dict) -> int:
    """How many values ``node`` stands for with every alias expanded (each anchor counted once
    per use; memoised, so the walk is linear in the file)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias counts once
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def kind_of(mode: int) -> str:
    """What a file that is not a regular file is, in words ("a directory", "a FIFO", ...)."""
    return ("a directory" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def parse_json(text: str, path: str | Path, fix: str = "") -> object:
    """Parse JSON ``text`` read from ``path``; errors say where (line:column)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if Path(path).suffix.lower() in (".yaml", ".yml"):  # a node.yaml given where JSON belongs
            raise HetplanError(f"{path}: is YAML (a node.yaml goes to --hw), not the JSON file expected "
                               f"here") from None
        raise HetplanError(f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}{fix}") from None
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        raise HetplanError(f"{path}: not a hetplan file: {str(e).split(';')[0]}{fix}") from None
    except RecursionError:
        raise HetplanError(f"{path}: JSON nested too deeply to be a hetplan file{fix}") from None


def writable_target(path: str | Path, option: str = "output") -> Path:
    """The regular file that writing ``path`` will replace (a symlink resolved), after checking
    that it can be written: refuses non-regular files and missing or read-only directories.
    Call it before long work so a bad ``-o`` fails first."""
    p = Path(path)
    if str(path) == "":
        raise HetplanError(f"{option}: empty file name; give a path such as plan.json")
    if str(path) == "-":
        raise HetplanError(f"{option} -: hetplan writes files, not standard output; give a file path "
                           f"(compile --json prints the summary on stdout)")
    target = Path(os.path.realpath(p)) if p.is_symlink() else p
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise HetplanError(f"{option} {path}: cannot use this path ({e.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise HetplanError(f"{option} {path}: is {kind_of(st.st_mode)}; hetplan writes only regular files: "
                           f"give a file path")
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise HetplanError(f"{option} {path}: directory {parent} {what}; create it or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HetplanError(f"{option} {path}: directory {parent} is not writable; "
                           f"choose another path or fix its permissions")
    return target


def distinct_targets(targets: dict, inputs: dict | None = None) -> None:
    """Refuse two options (``{"--trace": path, ...}``, unset ones None) that would write the same
    file (the second would silently replace the first), and an output that is one of the command's
    ``inputs`` (``{"PLAN": path}``: writing would destroy what is being read)."""
    read = {os.path.realpath(p): name for name, p in (inputs or {}).items() if p and os.path.isfile(p)}
    seen = {}
    for option, path in targets.items():
        if not path:
            continue
        key = os.path.realpath(path)
        if key in read:
            raise HetplanError(f"{option} {path}: is the {read[key]} this command reads; writing it would "
                               f"destroy it: give another file")
        if key in seen:
            raise HetplanError(f"{seen[key]} and {option} both write {path}; give each its own file")
        seen[key] = option


def write_atomic(path: str | Path, data: str | bytes, option: str = "output") -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring for the rules)."""
    target = writable_target(path, option)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        raise HetplanError(f"{option} {path}: cannot write in {target.parent} ({e.strerror})") from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise HetplanError(f"{option} {path}: could not write it ({e.strerror}); the old file, if any, "
                           f"is unchanged") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
