"""Fixtures shared by the GGUF tests."""

import pytest

from tests.tiny_models import TINY_GPU_NODE


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A node.yaml path: the tiny emulated-GPU node."""
    p = tmp_path_factory.mktemp("node") / "node.yaml"
    p.write_text(TINY_GPU_NODE)
    return str(p)
