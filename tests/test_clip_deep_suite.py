"""MaPLe, PromptSRC and PLOT end to end through the CLI on the tiny CLIP, offline."""

from __future__ import annotations

import math
import sqlite3

from typer.testing import CliRunner

from fpbench.cli import app

SUITE = """
name = "clip-deep-tiny"
seeds = [0]
[defaults]
backbone = { name = "clip-test" }
dataset = { num_classes = 4, image_size = 16, train_per_class = 8, test_per_class = 4 }
partition = { num_clients = 3, heldout_frac = 0.0 }
train = { rounds = 2, participation = 1.0, batch_size = 8, optimizer = "sgd", lr = 0.01, eval_every = 1 }
[[datasets]]
name = "synthetic"
[[partitions]]
name = "iid"
[[methods]]
name = "maple"
prompt_depth = 2
[[methods]]
name = "promptsrc"
prompt_depth_text = 2
prompt_depth_vision = 2
gpa_mean = 2.0
[[methods]]
name = "plot"
n_ctx = 4
n_prompts = 2
"""  # noqa: E501


def test_the_three_methods_run_end_to_end_and_are_stored_once(tmp_path, monkeypatch):
    # 2 rounds of each method; under load most of the time is the import of open_clip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "suite.toml").write_text(SUITE)
    first = CliRunner().invoke(app, ["run", "--suite", "suite.toml"])
    assert first.exit_code == 0, first.output
    db = tmp_path / "results" / "fpbench.db"
    with sqlite3.connect(db) as con:
        runs = dict(con.execute("select method, status from runs"))
        rounds = con.execute("select count(*) from rounds").fetchone()[0]
        final = {
            (m, name): v
            for m, name, v in con.execute(
                "select runs.method, name, value from metrics join runs on runs.id = run_id "
                "where client_id is null and name in ('params_trainable', 'acc_global')"
            )
        }
    assert runs == {"maple": "done", "promptsrc": "done", "plot": "done"}
    assert rounds == 3 * 2
    # text and vision widths 32: MaPLe 2 tokens x 2 layers + 2 linears 32 -> 32; PromptSRC
    # 4 + 4 tokens x 2 layers in each tower; PLOT 2 prompts of 4 tokens
    assert final["maple", "params_trainable"] == 2 * 2 * 32 + 2 * (32 * 32 + 32)
    assert final["promptsrc", "params_trainable"] == 4 * 4 * 32
    assert final["plot", "params_trainable"] == 2 * 4 * 32
    for m in runs:
        assert not math.isnan(final[m, "acc_global"])
    again = CliRunner().invoke(app, ["run", "--suite", "suite.toml"])
    assert again.exit_code == 0 and "3 already done" in again.output
