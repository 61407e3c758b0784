"""Every calibration test writes into its own cache folder (platformdirs reads XDG_CACHE_HOME on Linux), never the
user's."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path
