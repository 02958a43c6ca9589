import pytest

from tests.distributed.pipelines import NODE, save_llama


@pytest.fixture(scope="session")
def llama_files(tmp_path_factory):
    """(model directory, node.yaml, transformers model) of the tiny llama and the 4-GPU node."""
    d = tmp_path_factory.mktemp("llama")
    model = save_llama(d)
    (d.parent / "node.yaml").write_text(NODE)
    return d, d.parent / "node.yaml", model
