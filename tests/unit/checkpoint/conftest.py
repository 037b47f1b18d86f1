import pytest

from goodput.testing.tiny import tiny_run_config
from goodput.train.config.run import RunConfig


@pytest.fixture
def run_config(tmp_path) -> RunConfig:
    return tiny_run_config(tmp_path)
