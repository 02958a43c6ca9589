"""The one good plan the error tests start from: compiled once, by the CLI, from the working
directory's files (``workdir.populate``)."""

from __future__ import annotations

import pytest

from tests.errors.workdir import populate


@pytest.fixture(scope="session")
def good_plan(tmp_path_factory) -> str:
    """plan.json's text as ``hetplan compile config.json --hw node.yaml`` writes it."""
    from hetplan.cli import main

    folder = tmp_path_factory.mktemp("good")
    populate(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        assert main(["compile", "config.json", "--hw", "node.yaml", "-o", "plan.json"]) == 0
    return (folder / "plan.json").read_text()
