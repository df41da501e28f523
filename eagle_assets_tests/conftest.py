"""Shared fixtures: the embedded demo target (built once, cached under ./.eagle_assets) and the shared data dir."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def demo_target() -> Path:
    """Directory of the embedded demo target (a real tiny Qwen3 + tokenizer); builds it on first use (~2 min)."""
    from eagle_assets.demo.build import build_demo_target

    return Path(build_demo_target())


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"../shared/data is absent ({SHARED_DATA}): the real public samples are not on this machine")
    return SHARED_DATA


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one torch thread is faster and unaffected by other processes competing for the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
