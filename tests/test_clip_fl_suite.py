"""The federated CLIP prompt methods of issue #34 end to end: a tiny suite on the offline
`clip-test` CLIP, run through the CLI, each method's cell done with its metrics stored; and
`fpbench list methods` shows each with its paper."""

from __future__ import annotations

import sqlite3

import pytest
from typer.testing import CliRunner

from fpbench.cli import app

SUITE = """
name = "clip-fl-tiny"
seeds = [0]

[defaults]
backbone = {{ name = "clip-test" }}
dataset = {{ num_classes = 6, image_size = 16, train_per_class = 8, test_per_class = 4 }}
partition = {{ num_clients = 3, heldout_frac = 0.0, shots = 4 }}

[defaults.train]
rounds = 2
batch_size = 8
lr = 0.01
eval_every = 1
eval_last = 1
summary_window = 1

[[datasets]]
name = "synthetic"

[[partitions]]
name = "pathological"
s = 2

[[methods]]
name = "{method}"
{args}
"""

METHODS = {
    "fedclip": 'overrides = { train = { optimizer = "adam", lr = 5e-5, weight_decay = 0.2 } }',
    "fedpgp": "n_ctx = 4\nbottleneck = 2",
    "promptfolio": "n_ctx = 4",
    "fedtpg": "",
    "dp-fpl": "n_ctx = 4\nrank = 2\nepsilon = 0.4\n"
    "overrides = { train = { max_local_steps = 1, momentum = 0.0 } }",
    # clip-test's features are 32 wide; round 2 trains with the other clients as experts
    "pfedmoap": "n_ctx = 4\ngating_embed_dim = 16\ngating_heads = 4",
    "fedpha": "n_ctx = 4",
    "proda": "n_prompts = 3",
    # the conditional posterior (the suites run the default, coopvpt)
    "bpl": 'vpt_type = "cocoopvpt"\nn_samples = 2',
    # no attribute descriptions of the synthetic classes: each gets the one empty description
    "fedmvp": 'missing_descriptions = "class-name"',
}
PAPERS = {
    "fedclip": "FedCLIP",
    "fedpgp": "FedPGP",
    "promptfolio": "PromptFolio",
    "fedtpg": "FedTPG",
    "dp-fpl": "DP-FPL",
    "pfedmoap": "pFedMoAP",
    "fedpha": "FedPHA",
    "proda": "ProDA",
    "bpl": "BPL",
    "fedmvp": "FedMVP",
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_method_runs_end_to_end_through_the_cli(method, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "data"))
    suite = tmp_path / "suite.toml"
    suite.write_text(SUITE.format(method=method, args=METHODS[method]))
    db = tmp_path / "r.db"
    result = CliRunner().invoke(app, ["run", "--suite", str(suite), "--db", str(db)])
    assert result.exit_code == 0, result.output
    with sqlite3.connect(db) as con:
        runs = con.execute("select method, status from runs").fetchall()
        rounds = con.execute("select count(*) from rounds").fetchone()[0]
        names = {r[0] for r in con.execute("select name from metrics where client_id is null")}
    assert runs == [(method, "done")]
    assert rounds == 2
    assert "acc_global" in names or "acc_local_mean" in names, names


def test_list_methods_shows_each_with_its_paper():
    out = CliRunner().invoke(app, ["list", "methods"])
    assert out.exit_code == 0
    for name, paper in PAPERS.items():
        line = next(x for x in out.output.splitlines() if f" {name} " in x)
        assert paper in line, line
