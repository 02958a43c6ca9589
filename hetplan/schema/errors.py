"""Turning a schema violation into one line: file, line (where the format has lines), key, what
is wrong and what is accepted.

Knows pydantic's error records and YAML's node marks; knows nothing about any one file format.
"""

from __future__ import annotations

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
    from hetplan.schema.node import submodel

    model = root
    for part in loc:
        if isinstance(part, int):
            continue
        nxt = submodel(model, part)
        if nxt is None:
            return None
        model = nxt
    return model


def schema_error(e: ValidationError, root: type[BaseModel], source: str, text: str | None = None,
                 fix: str = "") -> HetplanError:
    """One line for the first error of ``e`` (validating ``root``), with how many more there are."""
    # an unknown key first: a misspelt key also makes the intended one look missing
    errs = sorted(e.errors(include_url=False), key=lambda x: x["type"] != "extra_forbidden")
    first = errs[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
    key = dotted(loc) or "(top level)"
    kind, msg = first["type"], first["msg"]
    line = yaml_line(text, loc) if text is not None else None
    where = f"{source}:{line}" if line else source
    more = f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        siblings = sorted({str(x["loc"][-1]) for x in errs if x["type"] == "extra_forbidden"
                           and tuple(x["loc"][:-1]) == tuple(first["loc"][:-1])})
        inside = f" in '{dotted(loc[:-1])}'" if loc[:-1] else ""
        accepted = sorted(fields_of(parent)) if parent else []
        return HetplanError(f"{where}: unknown keys {siblings}{inside}; accepted: {accepted}{fix}")
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        from hetplan.schema.node import range_of

        parent = _model_at(root, loc[:-1])
        field = fields_of(parent).get(loc[-1]) if parent and loc and isinstance(loc[-1], str) else None
        bounds = range_of(field) if field is not None else msg.lower()
        return HetplanError(f"{where}: '{key}' must be a number in {bounds}, got {first.get('input')!r}{fix}")
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        model = _model_at(root, loc)
        keys = f" with keys {', '.join(fields_of(model))}" if model else ""
        return HetplanError(f"{where}: {key}: expected a mapping{keys}, got {first.get('input')!r}{more}{fix}")
    if kind == "missing":
        # the key is not in the file, so there is no line to show
        return HetplanError(f"{source}: missing key '{key}'{fix}")
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    elif kind.endswith("_type"):
        msg = f"{msg.lower()}, got {first.get('input')!r}"[:200]
    return HetplanError(f"{where}: {key}: {msg}{more}{fix}")
