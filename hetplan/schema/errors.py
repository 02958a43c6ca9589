"""Turning a schema violation into one line: file, line (where the format has lines), key, what
is wrong and what is accepted.

Knows pydantic's error records, YAML's node marks and JSON positions (``positions``); knows
nothing about any one file format.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable

import yaml
from pydantic import BaseModel, ValidationError

from hetplan.errors import HetplanError


def fields_of(model: type) -> dict:
    """A model's fields by the key a file spells them with (its alias, e.g. ``class``)."""
    return {f.alias or name: f for name, f in model.model_fields.items()}


def dotted(loc: tuple) -> str:
    """('gpus', 0, 'memory') -> 'gpus[0].memory'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def yaml_line(text: str, loc: tuple) -> int | None:
    """The 1-based line of the node at ``loc`` in YAML ``text`` (the key's line for a mapping
    entry), or None when it cannot be found."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(part):
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _model_at(root: type, loc: tuple) -> type | None:
    """The model at ``loc`` below ``root``, stepping over list indices and the keys of mappings
    whose values are models (``layers["3"]``)."""
    from hetplan.schema.node import submodel

    model, key_next = root, False
    for part in loc:
        if isinstance(part, int) or key_next:
            key_next = False
            continue
        nxt = submodel(model, part)
        if nxt is None:
            return None
        key_next = _is_mapping(fields_of(model)[part].annotation)
        model = nxt
    return model


def _field_at(root: type, loc: tuple):
    """The field that holds ``loc``: the last named key of the path (an item of a list or of a
    mapping is held by the list's or mapping's field, whose annotation carries the item's range)."""
    for end in range(len(loc), 0, -1):
        part = loc[end - 1]
        parent = _model_at(root, loc[:end - 1])
        if isinstance(part, str) and parent is not None and part in fields_of(parent):
            return fields_of(parent)[part]
    return None


def _holds_int(annotation) -> bool:
    """Whether ``annotation`` is (an optional, annotated) ``int``."""
    if annotation is int:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _holds_int(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_holds_int(a) for a in typing.get_args(annotation) if a is not type(None))
    return False


def _is_mapping(annotation) -> bool:
    """Whether ``annotation`` is (an optional) ``dict[..., ...]``."""
    stack = [annotation]
    while stack:
        t = stack.pop()
        if typing.get_origin(t) is dict:
            return True
        if typing.get_origin(t) in (typing.Union, types.UnionType, typing.Annotated):
            stack.extend(typing.get_args(t))
    return False


def schema_error(e: ValidationError, root: type[BaseModel], source: str, text: str | None = None,
                 fix: str = "", line_of: Callable[[str, tuple], int | None] = yaml_line) -> HetplanError:
    """One line for the first error of ``e`` (validating ``root``), with how many more there are.
    ``line_of(text, loc)`` finds the line of a key path in the file's text (``yaml_line``, or
    ``positions.json_line`` for JSON files)."""
    # an unknown key first: a misspelt key also makes the intended one look missing
    errs = sorted(e.errors(include_url=False), key=lambda x: x["type"] != "extra_forbidden")
    first = errs[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
    key = dotted(loc) or "(top level)"
    kind, msg = first["type"], first["msg"]
    line = line_of(text, loc) if text is not None else None
    where = f"{source}:{line}" if line else source
    more = f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        siblings = sorted({str(x["loc"][-1]) for x in errs if x["type"] == "extra_forbidden"
                           and tuple(x["loc"][:-1]) == tuple(first["loc"][:-1])})
        inside = f" in '{dotted(loc[:-1])}'" if loc[:-1] else ""
        accepted = sorted(fields_of(parent)) if parent else []
        other = "" if loc[:-1] else looks_like(siblings)
        return HetplanError(f"{where}: unknown keys {siblings}{inside}; accepted: {accepted}{other}{fix}")
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        from hetplan.schema.node import range_of

        field = _field_at(root, loc)
        bounds = (range_of(field) if field is not None else "") or msg[0].lower() + msg[1:]
        what = "an integer" if field is not None and _holds_int(field.annotation) else "a number"
        return HetplanError(f"{where}: '{key}' must be {what} in {bounds}, got {_short(first.get('input'))}{fix}")
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        model = _model_at(root, loc)
        keys = f" with keys {', '.join(fields_of(model))}" if model else ""
        return HetplanError(f"{where}: {key}: expected a mapping{keys}, got {_short(first.get('input'))}{more}{fix}")
    if kind == "missing":
        # the key is not in the file, so there is no line to show
        return HetplanError(f"{source}: missing key '{key}'{fix}")
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        if not loc:  # a check across keys: the message names them
            return HetplanError(f"{where}: {msg}{more}{fix}")
    elif kind.endswith("_type") or kind in ("literal_error", "string_pattern_mismatch", "too_short", "too_long",
                                            "finite_number", "bool_parsing", "int_from_float"):
        msg = f"{msg[0].lower()}{msg[1:]}, got {_short(first.get('input'))}"
    return HetplanError(f"{where}: {key}: {msg}{more}{fix}")


KINDS = (
    ({"digest", "placement"}, "a plan written by `hetplan compile`"),
    ({"model_type"}, "a model's config.json (it goes as MODEL to `hetplan compile`)"),
    ({"gpus", "cpu", "links"}, "a node.yaml (it goes to --hw)"),
    ({"model_fingerprint", "layers"}, "routing statistics (they go to --routing)"),
    ({"machine", "entries"}, "a node.profile.json (a node.yaml names it under profile:)"),
    ({"traceEvents"}, "a trace written by --trace"),
)
"""Key sets that give away which hetplan file a document is."""


def looks_like(keys) -> str:
    """" (the file looks like a plan ...)" when the top-level ``keys`` are another kind's, else ""."""
    for marks, kind in KINDS:
        if marks <= set(keys):
            return f" (the file looks like {kind})"
    return ""


def _short(value) -> str:
    """``repr(value)``, cut to 60 characters (a whole subtree may be the offending input)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_json(model: type[BaseModel], d, source: str, text: str | None, what: str, fix: str):
    """``model.model_validate(d)`` for a JSON file, or the one-line error naming the file, line
    and key (``fix``: what to do, e.g. "; recompile it with `hetplan compile`")."""
    from hetplan.schema.positions import json_line

    try:
        return model.model_validate(d)
    except ValidationError as e:
        raise schema_error(e, model, source, text, line_of=json_line, fix=fix) from None
    except RecursionError:
        raise HetplanError(f"{source}: nested too deeply to be {what}{fix}") from None
