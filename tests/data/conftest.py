"""Shared fixtures of the data tests."""

import pytest

from eyas.common.assets import asset_path
from eyas.data.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct tokenizer (read from its GGUF: seconds, so once per session)."""
    return load_tokenizer(asset_path("smollm2-135m-instruct"))
