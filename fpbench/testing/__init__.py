"""The method conformance kit, shipped for plugin authors (as `optuna.testing` is).

A tiny federation (4 clients, synthetic data, the test-sized ViT or CLIP) that builds in well
under a second on a CPU, its pytest fixtures, and the checks every method must pass. In your own
package, put `pytest_plugins = ["fpbench.testing"]` in your top-level `conftest.py` to get the
fixtures (`tiny`, `fpbench_cache`), and subclass `MethodConformance` in a test module:

    from fpbench.testing import MethodConformance

    class TestMyMethod(MethodConformance):
        method = "my-method"
"""

from fpbench.testing.conformance import (
    MethodConformance,
    check_executors_agree,
    check_only_declared_tensors_are_communicated,
    check_recalled_equals_recomputed,
    check_round,
)
from fpbench.testing.tiny import (
    OFFLINE_ARGS,
    TINY,
    TINY_SUITE_TOML,
    fpbench_cache,
    seeded_server,
    tiny,
    tiny_config,
    with_config,
)

__all__ = [
    "OFFLINE_ARGS",
    "TINY",
    "TINY_SUITE_TOML",
    "MethodConformance",
    "check_executors_agree",
    "check_only_declared_tensors_are_communicated",
    "check_recalled_equals_recomputed",
    "check_round",
    "fpbench_cache",
    "seeded_server",
    "tiny",
    "tiny_config",
    "with_config",
]
