"""The example plugin installed once per test process into a temporary directory: subprocesses
with that directory on PYTHONPATH discover it through its entry point, this process never does."""
from __future__ import annotations

from pathlib import Path

import pytest
from plugin_cases import install_example


@pytest.fixture(scope="session")
def example_site(tmp_path_factory) -> Path:
    return install_example(tmp_path_factory.mktemp("example_plugin"))
