"""The README's node.yaml key table is the schema's own rendering, so the two cannot drift."""

from pathlib import Path

from hetplan.schema.node import node_keys_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_node_key_table_is_generated_from_the_schema():
    text = README.read_text()
    begin, end = "<!-- node-keys:begin -->\n", "<!-- node-keys:end -->"
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table == node_keys_table()


def test_every_schema_key_appears_in_the_table():
    from hetplan.schema.errors import fields_of
    from hetplan.schema.node import SECTIONS
    table = node_keys_table()
    for prefix, model in SECTIONS:
        for name in fields_of(model):
            assert f"`{prefix + '.' if prefix else ''}{name}`" in table
