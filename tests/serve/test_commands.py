"""The shared command-line pieces: a wrong draft head fails before the target loads."""

import re

import pytest

from eyas.common.target import TargetModel
from eyas.serve.commands import load_models


@pytest.mark.parametrize("exists, reason", [(True, "no config.json"), (False, "no such directory")])
def test_a_wrong_draft_fails_before_the_target_loads(tmp_path, monkeypatch, exists, reason):
    draft = tmp_path / "head"
    if exists:
        draft.mkdir()
    loaded = []
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *args, **kwargs: loaded.append(args))
    with pytest.raises(FileNotFoundError, match=re.escape(f"draft head {draft}: {reason}")):
        load_models(tmp_path, draft)
    assert not loaded
