"""Issue 29, part 4: what the review found beyond config values, each fixed or declared."""

from __future__ import annotations

from fpbench.suites import load_suite


def test_sdfed_table4_draws_each_clients_local_prompt_length_from_4_to_64():
    """SDFed sec. 4.1: in heterogeneous environments each local prompt has 4 to 64 tokens."""
    sdfed = [c for c in load_suite("clip-model-het").cells if c.method.name == "sdfed"]
    assert sdfed and {tuple(c.method.args["local_len_range"]) for c in sdfed} == {(4, 64)}
    assert {c.method.args["stretch_target"] for c in sdfed} == {"fixed"}


FEDPR_SUITES = {
    "sgpt-table1": 0.01, "sgpt-table2": 0.01, "label-het": 0.01, "feature-het": 0.01,
    "pep-table1": 0.1, "pep-table2": 0.1, "pep-table16": 0.1, "heldout": 0.1,
}  # fmt: skip


def test_fedpr_head_trains_as_the_other_baselines_heads_not_at_fedprs_adam():
    """FedPR's Adam 0.1 is for its prompts; its head (frozen in FedPR) takes the suite's SGD.
    PEP-FedPT's suites run its stated optimiser for every experiment (A.3.2: "stochastic
    Gradient Descent with momentum ... as the default optimizer with learning rate 0.1");
    feature-het's 60-client grid is PEP-FedPT Table 2's."""
    for name, suite_lr in FEDPR_SUITES.items():
        cells = [c for c in load_suite(name).cells if c.method.name == "fedpr"]
        assert cells, name
        for c in cells:
            lr = 0.1 if c.partition.label == "domain-60" else suite_lr
            prompts = ("sgd", 0.1) if lr == 0.1 else ("adam", 0.1)
            args = c.method.args
            assert (c.train.optimizer, c.train.lr) == prompts, name  # the prompts
            assert (args["head_optimizer"], args["head_lr"], args["head_momentum"]) == (
                "sgd", lr, 0.9,
            ), name  # fmt: skip


def test_pep_inat_lr_decay_is_declared_with_what_it_leaves_of_the_rate():
    from fpbench.report.paper import load_paper
    from fpbench.report.protocol import feeding_cells, load_protocol

    inat = [c for c in feeding_cells(load_paper("pep-fedpt")) if c.dataset == "inaturalist"]
    assert inat and {
        (c.config["train"]["rounds"], c.config["train"]["lr_decay"]) for c in inat
    } == {(500, 0.99)}
    (rule,) = [
        r
        for b in load_protocol("pep-fedpt")
        if b.match.get("dataset") == ("inaturalist",)
        for r in b.rules
        if r.path == "train.lr_decay"
    ]
    assert f"{100 * 0.99**500:.1f}% of the rate" in rule.deviation.reason


# -- fpbench's readings are rules in the protocol data --------------------------------------------


def _covered(paper: str) -> dict[str, set[str]]:
    """Per feeding cell: the reading keys of its method that no rule of the paper covers."""
    from fpbench.report.paper import load_paper
    from fpbench.report.protocol import _matches, feeding_cells, load_protocol

    blocks = load_protocol(paper)
    missing = {}
    for cell in feeding_cells(load_paper(paper)):
        keys = {f"readings.{k}" for k in cell.config["readings"]}
        for block in blocks:
            if cell.tables & set(block.tables) and _matches(block.match, cell):
                keys -= {r.path for r in block.rules if _matches(r.match, cell)}
        if keys:
            missing[cell.name] = keys
    return missing


def test_every_reading_of_a_feeding_method_is_a_rule_of_its_papers_protocol():
    from fpbench.report.paper import list_papers

    assert set(list_papers()) == {"sgpt", "fgpt", "pep-fedpt", "sdfed", "tpfl", "clip-ground"}
    for paper in list_papers():
        assert _covered(paper) == {}, paper


def test_readings_name_registered_methods_and_a_method_declares_none():
    import pytest

    from fpbench.registry import METHODS
    from fpbench.report.method_readings import READINGS, method_readings
    from fpbench.report.protocol import readings_of

    assert set(READINGS) <= set(METHODS.names())
    assert method_readings("fedvpt") == {"official_check": "none"}
    assert readings_of("atpfl") == {
        "official_check": "none",
        "optimizer_state": "fresh-per-round",
        "z": "class-text-features+image-features",
    }
    with pytest.raises(Exception, match="no-such-method"):
        readings_of("no-such-method")


def test_methods_checked_against_official_code_are_those_the_differential_test_runs():
    from fpbench.registry import METHODS
    from fpbench.report.method_readings import method_readings
    from tests.peer import load_script

    kinds = set()
    harnesses = ("official", "clip_reference", "official_deep", "official_clip_fl",
                 "official_clip_fl_2025", "official_bpl", "official_fedmvp")  # fmt: skip
    for name in harnesses:
        kinds |= {kind for kind, _ in load_script(name).CASES.values()}
    checked = {
        name for name in METHODS.names() if method_readings(name)["official_check"] != "none"
    }  # fmt: skip
    assert checked == {"promptfl", "fedotp", "sgpt", "fedpr", "zero-shot", "kgcoop", "cocoop",
                       "prograd", "maple", "promptsrc", "plot", "fedpgp", "fedclip",
                       "promptfolio", "fedtpg", "dp-fpl", "pfedmoap", "fedpha", "bpl",
                       "fedmvp"}  # fmt: skip
    assert kinds == {"coop", "fedotp", "sgpt", "fedpr", "zsclip", "kgcoop", "cocoop", "prograd",
                     "maple", "promptsrc", "plot", "fedpgp", "fedclip", "promptfolio", "fedtpg",
                     "dpfpl", "pfedmoap", "fedpha", "bpl", "fedmvp"}  # fmt: skip


NEW_PATHS = {
    "sdfed": {
        "method.args.stretch_target": "pinned",
        "method.args.local_len_range": "pinned",
        "readings.official_check": "pinned",
        "readings.optimizer_state": "declared",
        "readings.ot_stop": "declared",
        "readings.d": "declared",
        "readings.generation": "declared",
    },
    "sgpt": {
        "method.args.head_optimizer": "declared",
        "method.args.head_lr": "declared",
        "method.args.head_momentum": "declared",
        "method.args.head_weight_decay": "declared",
        "readings.adam_eps": "declared",
        "readings.official_check": "pinned",
    },
    "pep-fedpt": {
        "method.args.head_optimizer": "declared",
        "method.args.head_lr": "declared",
        "readings.optimizer_state": "declared",
        "train.lr_decay": "declared",
    },
    "tpfl": {
        "train.rounds": "declared",
        "train.lr_schedule": "pinned",
        "readings.z": "declared",
        "readings.official_check": "pinned",
    },
    "fgpt": {"readings.official_check": "pinned"},
}


def test_the_settings_and_readings_of_part_4_are_leaf_paths_held_by_their_papers_rules():
    """The new method arguments and the virtual readings.* paths reach the completeness check
    (as leaf paths of the feeding cells) and are covered by the kind of rule each needs."""
    from fpbench.report.protocol import paper_coverage

    for paper, want in NEW_PATHS.items():
        kinds = paper_coverage(paper).kinds
        assert {path: kinds.get(path) for path in want} == want, paper
