"""Fixtures shared by the GGUF tests."""

import pytest

from tests.tiny_models import TINY_GPU_NODE


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A node.yaml path: the tiny emulated-GPU node."""
    p = tmp_path_factory.mktemp("node") / "node.yaml"
    p.write_text(TINY_GPU_NODE)
    return str(p)


@pytest.fixture(autouse=True)
def fp32_activations(monkeypatch):
    """The GGUF logits are held to 1e-4 of transformers on the dequantised weights: x multiplied
    in fp32 (the int8-activation decode kernel has its own bound, ``tests/exec/test_int8_kernels``)."""
    monkeypatch.setenv("HETPLAN_INT8_DECODE", "0")
    monkeypatch.setenv("HETPLAN_INT8_PREFILL", "0")
