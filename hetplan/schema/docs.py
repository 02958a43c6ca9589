"""The README's key tables of the JSON files, rendered from their schemas so the two cannot drift.

One table per file (``TABLES``: plan.json, node.profile.json, routing statistics, config.json as
read); each row is a key with its type (and SI unit), its range, its default and its meaning.
node.yaml's table is ``hetplan.schema.node.node_keys_table`` (it shows units as written there).
"""

from __future__ import annotations

import types
import typing
from typing import Literal

from hetplan.schema import config, plan, profile, routing
from hetplan.schema.node import _extra, range_of, submodel_type

TABLES = {"plan-keys": plan.SECTIONS, "profile-keys": profile.SECTIONS, "routing-keys": routing.SECTIONS,
          "config-keys": config.SECTIONS}
"""README marker name (``<!-- NAME:begin -->`` .. ``<!-- NAME:end -->``) -> where each model sits."""


def _type_of(annotation) -> str:
    """A field's type in words: ``number (bytes)``, ``one of `gpu`, `cpu` ``, ``list of integer``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_of(args[0])
    if origin in (typing.Union, types.UnionType):
        named = [_type_of(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {_type_of(args[0])}"
    if origin is dict:
        return f"mapping to {_type_of(args[1])}"
    if submodel_type(annotation) is not None:
        return "mapping"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(annotation, "value")


def _type_column(field) -> str:
    unit = _extra(field).get("si")
    shown = _type_of(field.annotation)
    return shown.replace("number", f"number ({unit})", 1) if unit not in (None, "x") and "number" in shown else shown


def _default_of(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None or field.default is None:
        return ""
    return f"`{str(field.default).lower() if isinstance(field.default, bool) else field.default}`"


def keys_table(sections) -> str:
    """A Markdown table of every key of the models in ``sections`` ((prefix, model) pairs)."""
    lines = ["| key | type | range | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for prefix, model in sections:
        for name, field in model.model_fields.items():
            key = field.alias or name
            shown = ", ".join(f"`{p}.{key}`" for p in prefix.split(", ")) if prefix else f"`{key}`"
            lines.append(f"| {shown} | {_type_column(field)} | {range_of(field)} | {_default_of(field)} | "
                         f"{field.description or ''} |")
    return "\n".join(lines) + "\n"
