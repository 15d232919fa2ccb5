"""The CLIP methods run what the SDFed and TPFL papers ran; each test fails on the old code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fpbench.engine.executor import train_clients
from fpbench.methods.base import Context

from .conftest import seeded_server


# -- TPFL / ATPFL's visual prompt ---------------------------------------------------------------
def test_tpfl_initial_visual_prompt_leaves_clip_zero_shot_logits_unchanged(tiny):
    _, task, method = tiny("tpfl")
    server = seeded_server(method)
    params = method.client_params(server, torch.tensor([0]))
    x = method.backbone.preprocess(task.data.test_images[:6])
    rows = torch.zeros(6, dtype=torch.long)
    logits = method.forward(params, x, rows, Context(training=False))
    plain = F.normalize(method.backbone.encode_image(x).float(), dim=-1)  # no prompt at all
    text = method.text_features(params["ctx"])
    torch.testing.assert_close(logits, method.logits(plain, text, rows), atol=1e-5, rtol=1e-5)


def test_tpfl_visual_prompt_moves_within_a_few_steps(tiny):
    # the suite's Adam at lr 1e-3 moved a pixel by at most 0.003 in these 2-3 steps
    cfg, task, method = tiny("tpfl", optimizer="adam", lr=0.001)
    server = seeded_server(method)
    ids = task.trainable_clients()
    out = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    moved = (out.params["visual_prompt"] - server.params["visual_prompt"]).abs()
    assert moved.mean() > 0.02 and moved.max() > 0.1
    # the text context still trains with the run's Adam: each step moves it by at most ~lr
    ctx_moved = (out.params["ctx"] - server.params["ctx"].unsqueeze(0)).abs().max()
    assert 0 < ctx_moved <= 3 * 0.001 * 1.01


def test_visual_prompt_follows_its_own_optimiser_and_the_run_schedule(tiny):
    from fpbench.engine.executor import phase_optimizer
    from fpbench.engine.optim import StackedAdam, StackedSGD

    cfg, _, method = tiny("tpfl", optimizer="adam", lr=0.002)
    phase = method.phases(1, ("ctx", "visual_prompt"))[0]
    tensors = [torch.zeros(2, 3), torch.zeros(2, 4)]
    group = phase_optimizer(cfg.train, tensors, phase, lr=0.001)  # half of train.lr
    adam, sgd = group.optimizers
    assert isinstance(adam, StackedAdam) and adam.params == [tensors[0]] and adam.lr == 0.001
    assert isinstance(sgd, StackedSGD) and sgd.params == [tensors[1]]
    assert sgd.lr == 20.0 and sgd.momentum == 0.9 and sgd.weight_decay == 0.0


# -- UOPP's dual head ---------------------------------------------------------------------------
def test_uopp_both_heads_can_win_at_clip_scale():
    from fpbench.methods.uopp import dual_head

    # cosines as CLIP gives them: image-text ones narrow, image-prototype ones wide
    prompt = 100 * torch.tensor([[0.26, 0.22, 0.21, 0.20], [0.24, 0.23, 0.22, 0.21]])
    proto = 100 * torch.tensor([[0.95, 0.85, 0.60, 0.55], [0.95, 0.40, 0.38, 0.36]])
    out = dual_head(prompt, proto)
    # sample 0: the prompt's top class stands further out of its spread; sample 1: the prototype's
    # (the raw softmax picked the prototype head for both: its margins are 10 and 55 logits)
    assert torch.equal(out, torch.stack([prompt[0], proto[1]]))


def test_uopp_prototype_statistics_skip_classes_without_a_prototype():
    from fpbench.methods.uopp import calibrated_confidence

    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0]])
    valid = torch.tensor([True, True, False, False])
    # over the two valid classes the standardised logits are (1, -1)
    expected = torch.tensor([1.0, -1.0]).softmax(-1).amax()
    torch.testing.assert_close(calibrated_confidence(logits, valid), expected.view(1))


# -- Powder's start prompt -----------------------------------------------------------------------
def test_powder_gives_uncorrelated_clients_no_weight(tiny):
    _, task, method = tiny("powder")
    server = seeded_server(method)
    server.buffers["pool_seen"] = torch.ones(task.num_clients)
    priors = torch.zeros(task.num_clients, task.data.num_classes)
    for c in range(task.num_clients):  # disjoint classes: every pair has correlation 0
        priors[c, c] = 1.0
    task.class_priors = priors
    method.task = task
    pool = torch.stack([torch.full_like(server.params["ctx"], float(c + 1)) for c in range(4)])
    server.buffers["pool"] = pool
    start = method.generate(server, torch.tensor([0]))
    # only G (the federation's prior shares the client's class); the old softmax over all gave
    # the three unrelated tasks e^0 each next to G's e^(cos / 0.1)
    torch.testing.assert_close(start[0], server.params["ctx"])


# -- GPT-FL without generated images ------------------------------------------------------------
GPT_FL_SUITE = """
name = "gptfl"
seeds = [0]
[defaults]
backbone = { name = "clip-test" }
dataset = { num_classes = 4, image_size = 16, train_per_class = 4, test_per_class = 2 }
partition = { num_clients = 2, heldout_frac = 0.0 }
train = { rounds = 1, batch_size = 8 }
[[datasets]]
name = "synthetic"
[[partitions]]
name = "iid"
[[methods]]
name = "gpt-fl"
synthetic_dir = "generated/{dataset}"
"""


def test_gpt_fl_run_without_images_stops_before_writing_anything(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fpbench.cli import app
    from tests.conftest import error_messages

    monkeypatch.chdir(tmp_path)
    (tmp_path / "gptfl.toml").write_text(GPT_FL_SUITE)
    result = CliRunner().invoke(app, ["run", "--suite", "gptfl.toml", "--db", "results/x.db"])
    assert result.exit_code == 2, result.stdout
    assert error_messages(result.stderr) == [
        "error: gpt-fl needs generated images in 'generated/synthetic': run `fpbench data "
        "generate-gpt-fl synthetic --out generated/synthetic --model /path/to/text-to-image`"
    ]
    assert not (tmp_path / "results").exists()


def _local_mean_run(store, method, seed, value, cfg):
    rec = store.create_run(
        run_key=f"{method}-{seed}", suite="clip-single-domain", method=method,
        dataset="flowers102", partition="path-10", seed=seed, config=cfg,
        fpbench_version="test", torch_version="test", device="cpu",
    )  # fmt: skip
    store.write_round(rec.id, 0, loss_train=1.0, wall_s=1.0, bytes_up=0, bytes_down=0,
                      metrics=[(None, "acc_local_mean", value, None)])  # fmt: skip


def test_sdfed_gpt_fl_cell_needs_generated_images_not_a_promptfl_number(tmp_path):
    from fpbench.report.paper import fill_paper, load_paper, load_results
    from fpbench.store import Store

    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    vit = {"backbone": {"name": "clip-vit-b16"}}
    without = {**vit, "method": {"name": "gpt-fl", "args": {"synthetic_dir": None}}}
    with_images = {**vit, "method": {"args": {"synthetic_dir": "generated/gpt-fl/{dataset}"}}}
    _local_mean_run(store, "gpt-fl", 0, 0.9, without)
    _local_mean_run(store, "coop", 0, 0.9, without)
    table = fill_paper(load_paper("sdfed"), load_results(store), 1)[0]
    assert table.cell("coop", "flowers102-vit").n == 1  # the same stored shape fills a cell
    cell = table.cell("gpt-fl", "flowers102-vit")
    assert cell.n == 0
    assert cell.hint() == (
        "needs generated images (suite clip-single-domain: gpt-fl/flowers102/path-10)"
    )
    _local_mean_run(store, "gpt-fl", 1, 0.8, with_images)
    table = fill_paper(load_paper("sdfed"), load_results(store), 1)[0]
    cell = table.cell("gpt-fl", "flowers102-vit")
    assert (cell.n, cell.mean) == (1, pytest.approx(80.0))
    store.close()


# -- TPFL Tables 1-2 read the all-class test set ------------------------------------------------
def test_tpfl_tables_score_every_row_on_the_all_class_test_set(tmp_path):
    from fpbench.report.paper import fill_paper, load_paper, load_results
    from fpbench.store import Store

    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    rec = store.create_run(
        run_key="local-0", suite="clip-fewshot", method="local", dataset="eurosat",
        partition="few-shot", seed=0, config={"backbone": {"name": "clip-vit-b16"}},
        fpbench_version="test", torch_version="test", device="cpu",
    )  # fmt: skip
    # a client of one class scores ~100% on its own classes, ~1/10 + zero-shot help on all
    metrics = [(None, "acc_local_mean", 0.99, None), (None, "acc_global", 0.26, None)]
    store.write_round(rec.id, 0, loss_train=1.0, wall_s=1.0, bytes_up=0, bytes_down=0,
                      metrics=metrics)  # fmt: skip
    paper = load_paper("tpfl")
    cell = fill_paper(paper, load_results(store), 1)[0].cell("local", "eurosat")
    assert cell.mean == pytest.approx(26.0)
    for number in (1, 2):
        t = paper.table(number)
        assert {t.spec(r, c)["metric"] for r in t.rows for c in t.columns} == {"acc_global"}
    store.close()


# -- macro F1 (TPFL Figs. 2-3) --------------------------------------------------------------------
def test_macro_f1_by_hand():
    import numpy as np

    from fpbench.engine.metrics import macro_f1

    # class 0: tp 1, 2 predicted, 1 true -> 2/3; class 1: tp 1, 1 predicted, 3 true -> 1/2;
    # class 2: predicted once, never true -> 0; class 3 never occurs and is left out
    f1 = macro_f1(np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1]), 4)
    assert f1 == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)


def test_f1_macro_global_is_recorded_per_round_for_global_and_personal_methods(tiny):
    import numpy as np

    from fpbench.engine.evaluate import evaluate
    from fpbench.engine.metrics import EvalCounts, aggregates, macro_f1

    counts = EvalCounts(
        correct_local=np.array([1, 1, 1]), total_local=np.array([2, 2, 2]),
        heldout=np.array([False, False, True]), global_acc=np.array([0.5, 0.5, np.nan]),
        global_total=4, f1_global=np.array([0.5, 0.7, np.nan]),
    )  # fmt: skip
    assert aggregates(counts)["f1_macro_global"] == pytest.approx(0.6)
    _, task, method = tiny("promptfl")
    server = seeded_server(method)
    ev = evaluate(method, server, task, 64)
    params = method.client_params(server, torch.zeros(1, dtype=torch.long), training=False)
    x = task.data.test_images
    rows = torch.zeros(len(x), dtype=torch.long)
    images = method.backbone.preprocess(x)
    pred = method.forward(params, images, rows, Context(training=False)).argmax(-1)
    expected = macro_f1(pred.numpy(), task.data.test_labels.numpy(), task.data.num_classes)
    assert ev.f1_global.tolist() == [pytest.approx(expected)]
    _, task, local = tiny("coop-local")
    ev = evaluate(local, seeded_server(local), task, 64)
    assert np.isfinite(ev.f1_global[~task.heldout.numpy()]).all()


# -- tables rendered from measured values --------------------------------------------------------
def test_fgpt_table2_and_sdfed_table5_read_measured_parameters_and_round_times(tmp_path):
    from fpbench.report.paper import fill_paper, load_paper, load_results
    from fpbench.store import Store

    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    rec = store.create_run(
        run_key="fgpt", suite="fgpt-table1", method="fgpt", dataset="cifar100",
        partition="path-s10", seed=0, config={}, fpbench_version="t", torch_version="t",
        device="cpu",
    )  # fmt: skip
    store.write_round(rec.id, 0, loss_train=1.0, wall_s=1.0, bytes_up=0, bytes_down=0,
                      metrics=[(None, "params_trainable", 92_160.0, None)])  # fmt: skip
    rec = store.create_run(
        run_key="sdfed", suite="clip-single-domain", method="sdfed", dataset="flowers102",
        partition="path-10", seed=0, config={"backbone": {"name": "clip-vit-b16"}},
        fpbench_version="t", torch_version="t", device="cpu",
    )  # fmt: skip
    for r, wall in enumerate([4.0, 4.2, 9.0]):  # the last round also evaluates
        store.write_round(rec.id, r, loss_train=1.0, wall_s=wall, bytes_up=0, bytes_down=0,
                          metrics=[(None, "acc_local_mean", 0.9, None)])  # fmt: skip
    results = load_results(store)
    fgpt = fill_paper(load_paper("fgpt"), results, 2)[0]
    assert fgpt.cell("params", "ours-vit").mean == pytest.approx(0.09216)  # millions
    assert fgpt.cell("params", "fedavg-vit").hint() == "reference only (not produced by fpbench)"
    sdfed = fill_paper(load_paper("sdfed"), results, 5)[0]
    assert sdfed.cell("training", "time").mean == pytest.approx(4200.0)  # median, in ms
    store.close()


# -- CoOp-style training settings in the paper suites -------------------------------------------
SDFED_SUITES = ("clip-single-domain", "clip-multi-domain", "clip-model-het", "clip-dirichlet",
                "sdfed-ablations")  # fmt: skip


def test_clip_paper_suites_train_as_the_reference_code_does():
    from fpbench.suites import load_suite

    for name in (*SDFED_SUITES, "sdfed-sweeps", "clip-fewshot", "clip-fewshot-sweeps"):
        cells = load_suite(name).cells
        assert {c.train.weight_decay for c in cells} == {5e-4}, name  # Dassl's default
        if name in SDFED_SUITES:
            assert {c.seed for c in cells} == {0, 1, 2, 3, 4}, name  # SDFed: five seeds
    fedotp = [c for c in load_suite("clip-dirichlet").cells if c.method.name == "fedotp"]
    assert fedotp and {c.method.args["eps"] for c in fedotp} == {0.1}  # FedOTP's CIFAR script
    fewshot = [c for c in load_suite("clip-single-domain").cells if c.method.name == "fedotp"]
    assert {c.method.args["eps"] for c in fewshot} == {0.01}  # its few-shot scripts


# -- SDFed's and TPFL's protocols live as data and the protocol test holds the suites to them -----
def test_sdfed_and_tpfl_protocols_cover_every_table_with_a_suite():
    from fpbench.report.paper import load_paper
    from fpbench.report.protocol import check_paper, load_protocol

    for name in ("sdfed", "tpfl"):
        covered = {n for block in load_protocol(name) for n in block.tables}
        with_suite = {t.number for t in load_paper(name).tables if t.defaults.get("suite")}
        assert covered == with_suite, name
        assert check_paper(name) == [], name
