"""Issue 29, part 4: what the review found beyond config values, each fixed or declared."""

from __future__ import annotations

from fpbench.suites import load_suite


def test_sdfed_table4_draws_each_clients_local_prompt_length_from_4_to_64():
    """SDFed sec. 4.1: in heterogeneous environments each local prompt has 4 to 64 tokens."""
    sdfed = [c for c in load_suite("clip-model-het").cells if c.method.name == "sdfed"]
    assert sdfed and {tuple(c.method.args["local_len_range"]) for c in sdfed} == {(4, 64)}
    assert {c.method.args["stretch_target"] for c in sdfed} == {"fixed"}
