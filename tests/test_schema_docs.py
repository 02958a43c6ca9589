"""The README's key tables are the schemas' own renderings, so the two cannot drift."""

from pathlib import Path

import pytest

from hetplan.schema.docs import TABLES, keys_table
from hetplan.schema.node import node_keys_table

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(name: str) -> str:
    text = README.read_text()
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    return text[text.index(begin) + len(begin):text.index(end)]


def test_readme_node_key_table_is_generated_from_the_schema():
    assert readme_block("node-keys") == node_keys_table()


@pytest.mark.parametrize("name", sorted(TABLES))
def test_readme_key_table_of_each_json_file_is_generated_from_its_schema(name):
    assert readme_block(name) == keys_table(TABLES[name])


def test_every_schema_key_appears_in_the_table():
    from hetplan.schema.errors import fields_of
    from hetplan.schema.node import SECTIONS
    table = node_keys_table()
    for prefix, model in SECTIONS:
        for name in fields_of(model):
            assert f"`{prefix + '.' if prefix else ''}{name}`" in table


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_model_of_a_json_schema_has_a_place_in_its_table(name):
    """Each nested model of the file's root is listed in its sections, so none of its keys is
    missing from the README."""
    from hetplan.schema.node import submodel_type
    listed = {model for _, model in TABLES[name]}
    stack, seen = [TABLES[name][0][1]], set()
    while stack:
        model = stack.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            sub = submodel_type(field.annotation)
            if sub is not None:
                stack.append(sub)
    missing = {m.__name__ for m in seen} - {m.__name__ for m in listed}
    assert not missing, f"models without a table section: {missing}"
