import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402


@pytest.fixture(autouse=True)
def shm_clean():
    """Every test leaves /dev/shm as it found it: no easyckpt segment of its own may remain."""
    before = set(harness.shm_segments())
    yield
    after = set(harness.shm_segments()) - before
    assert not after, f"test left shared-memory segments behind: {sorted(after)}"
