"""Shared fixtures: the tiny federation of `fpbench.testing` (synthetic data, test-sized ViT),
the kit that ships with fpbench; its names are re-exported here for the tests that import them."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.register_assert_rewrite("fpbench.testing")  # its checks' asserts explain themselves

from fpbench.testing import (  # noqa: E402, F401  (names the test modules import from here)
    OFFLINE_ARGS,
    TINY,
    TINY_SUITE_TOML,
    seeded_server,
    tiny_config,
    with_config,
)

pytest_plugins = ["fpbench.testing"]  # the fixtures `tiny` and `fpbench_cache`


@pytest.fixture(autouse=True)
def _own_cache_folder(fpbench_cache: Path) -> Path:
    """Every test gets its own fpbench cache folder (see `fpbench.testing.fpbench_cache`)."""
    return fpbench_cache
