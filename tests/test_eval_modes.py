"""Evaluation modes: CoOp's class split, the held-out domain, the mode's config, and the scores
of the trained prompts on other class names, against an independent computation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fpbench.data.base import ImageDataset
from fpbench.engine.build import build_populations
from fpbench.engine.eval_modes import class_split, derived, split_for, without_domain
from fpbench.engine.rounds import score_targets
from fpbench.engine.task import build_task, load_dataset
from fpbench.errors import FpbenchError
from fpbench.specs import Evaluation
from fpbench.suites import expand_suite
from fpbench.testing.tiny import cell_of

CPU = torch.device("cpu")


def _data(labels_tr, labels_te, domains_tr=None, domains_te=None, names=None) -> ImageDataset:
    n, m = len(labels_tr), len(labels_te)
    return ImageDataset(
        name="toy",
        train_images=torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 2, 2),
        train_labels=torch.tensor(labels_tr),
        test_images=torch.arange(m, dtype=torch.uint8).view(m, 1, 1, 1).expand(m, 3, 2, 2),
        test_labels=torch.tensor(labels_te),
        class_names=names or ["a", "b", "c", "d", "e"],
        train_domains=None if domains_tr is None else torch.tensor(domains_tr),
        test_domains=None if domains_te is None else torch.tensor(domains_te),
        domain_names=None if domains_tr is None else ["d0", "d1", "d2"],
    )


def test_class_split_is_coops_base_first_half_rounded_up():
    # 5 classes: base = labels 0, 1, 2 (ceil(5/2) = 3); novel = 3, 4 re-indexed to 0, 1
    data = _data([0, 4, 1, 3, 2, 0], [3, 0, 4, 2, 1])
    base, novel = class_split(data)
    assert base.class_names == ["a", "b", "c"] and novel.class_names == ["d", "e"]
    assert base.train_labels.tolist() == [0, 1, 2, 0]
    assert base.train_images[:, 0, 0, 0].tolist() == [0, 2, 4, 5]  # the samples kept, in order
    assert base.test_labels.tolist() == [0, 2, 1]
    assert base.test_images[:, 0, 0, 0].tolist() == [1, 3, 4]
    assert novel.test_labels.tolist() == [0, 1]  # labels 3, 4
    assert novel.test_images[:, 0, 0, 0].tolist() == [0, 2]
    assert novel.train_labels.tolist() == [1, 0]  # labels 4, 3
    # an even count splits in halves
    four = class_split(_data([0, 1, 2, 3], [3, 2], names=["a", "b", "c", "d"]))
    assert [d.class_names for d in four] == [["a", "b"], ["c", "d"]]
    assert base.identity is None  # none to tag
    # per-sample domains and users follow their samples
    users = dataclasses.replace(
        _data([0, 4, 1, 3, 2, 0], [3, 0, 4, 2, 1], [0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1]),
        train_users=torch.tensor([5, 6, 7, 8, 9, 4]),
    )
    base, novel = class_split(users)
    assert base.train_domains.tolist() == [0, 2, 1, 2] and base.test_domains.tolist() == [1, 0, 1]
    assert base.train_users.tolist() == [5, 7, 9, 4] and novel.train_users.tolist() == [6, 8]
    assert novel.test_domains.tolist() == [0, 2]
    # two classes are enough; the halves' identities are tagged; coarse groups follow
    two = dataclasses.replace(
        _data([0, 1, 1], [1, 0], names=["a", "b"]),
        identity="toy-3",
        coarse_of_class=torch.tensor([7, 8]),
    )
    base, novel = class_split(two)
    assert (base.class_names, novel.class_names) == (["a"], ["b"])
    assert (base.identity, novel.identity) == ("toy-3/base", "toy-3/novel")
    assert (base.coarse_of_class.tolist(), novel.coarse_of_class.tolist()) == ([7], [8])
    with pytest.raises(FpbenchError) as info:
        class_split(_data([0], [0], names=["a"]))
    assert str(info.value) == "base-to-novel needs at least 2 classes; toy has 1"


def test_without_domain_reindexes_the_others_and_keeps_the_held_out_test_images():
    data = _data([0, 1, 2, 0, 1], [0, 1, 2, 2], [0, 1, 2, 2, 1], [2, 1, 0, 1])
    rest, held = without_domain(data, "D1")  # names compare as `domain_key`s
    assert rest.domain_names == ["d0", "d2"] and held.domain_names == ["d1"]
    assert rest.train_domains.tolist() == [0, 1, 1]  # d0, d2, d2: d2 becomes 1
    assert rest.train_images[:, 0, 0, 0].tolist() == [0, 2, 3]
    assert rest.test_domains.tolist() == [1, 0]
    assert held.test_images[:, 0, 0, 0].tolist() == [1, 3] and held.test_labels.tolist() == [1, 2]
    with pytest.raises(FpbenchError, match="no domain 'd7'; its domains: d0, d1, d2"):
        without_domain(data, "d7")


def test_without_domain_carries_sizes_identity_and_the_held_domains_train_samples():
    """The rest keeps the other domains' full sizes and a tagged identity; the held-out domain
    is domain 0 of its own (long) domain tensors, with its train samples too. Two domains are
    enough; a dataset that names domains must give them per test sample."""
    data = dataclasses.replace(
        _data([0, 1, 2, 0, 1], [0, 1, 2, 2], [0, 1, 2, 2, 1], [2, 1, 0, 1]),
        domain_train_sizes=torch.tensor([50, 30, 20]),
        identity="toy-7",
    )
    rest, held = without_domain(data, "d1")
    assert rest.domain_train_sizes.tolist() == [50, 20]
    assert held.domain_train_sizes.tolist() == [30]
    assert (rest.identity, held.identity) == ("toy-7/without-d1", "toy-7/domain-d1")
    assert held.train_images[:, 0, 0, 0].tolist() == [1, 4] and held.train_labels.tolist() == [1, 1]
    assert held.train_domains.tolist() == [0, 0] and held.test_domains.tolist() == [0, 0]
    assert held.train_domains.dtype == held.test_domains.dtype == torch.long
    last, held = without_domain(data, "d2")  # the last index: nothing above it moves
    assert last.domain_train_sizes.tolist() == [50, 30]
    assert held.domain_train_sizes.tolist() == [20]
    assert held.train_domains.tolist() == [0, 0] and held.test_domains.tolist() == [0]
    two = dataclasses.replace(
        _data([0, 1, 2], [0, 1], [0, 1, 1], [1, 0]), domain_names=["d0", "d1"]
    )
    rest, held = without_domain(two, "d0")
    assert rest.domain_names == ["d1"] and rest.train_domains.tolist() == [0, 0]
    assert held.test_images[:, 0, 0, 0].tolist() == [1]
    with pytest.raises(FpbenchError, match="none \\(a single-domain dataset\\)$"):
        without_domain(_data([0], [0]), "d0")
    with pytest.raises(AssertionError):
        without_domain(dataclasses.replace(data, test_domains=None), "d1")


def test_split_for_gives_each_mode_its_training_set_and_named_scored_sets():
    """What a run trains on and what it also scores, per mode, with each set's name and whether
    the run's own method instance (its class names) scores it."""
    data = _data([0, 1, 2, 0, 1], [0, 1, 2, 2], [0, 1, 2, 2, 1], [2, 1, 0, 1])
    assert split_for(None, data) == (data, [])
    base, (novel,) = split_for(Evaluation(mode="base2novel"), data)
    assert base.class_names == ["a", "b", "c"] and base.train_labels.tolist() == [0, 1, 2, 0, 1]
    assert (novel.name, novel.same_classes, novel.data.class_names) == ("novel", False, ["d", "e"])
    rest, (held,) = split_for(Evaluation(mode="leave-one-domain-out", domain="D1"), data)
    assert rest.domain_names == ["d0", "d2"] and rest.train_images[:, 0, 0, 0].tolist() == [0, 2, 3]
    assert (held.name, held.same_classes, held.data.domain_names) == ("lodo", True, ["d1"])
    targets = [{"name": "synthetic", "label": "Some_Set"}, {"name": "synthetic", "label": "b"}]
    loaded = []
    xd = Evaluation(mode="cross-dataset", targets=targets)
    same, sets = split_for(xd, data, lambda t: loaded.append(t) or f"data of {t.label}")
    assert same is data and loaded == list(xd.targets)
    assert [(e.name, e.data, e.same_classes) for e in sets] == [
        ("xd_some-set", "data of Some_Set", False),
        ("xd_b", "data of b", False),
    ]


def test_harmonic_mean_and_cross_dataset_mean():
    b2n = Evaluation(mode="base2novel")
    assert derived(b2n, {"acc_global": 0.6, "acc_novel": 0.3}) == {
        "acc_base": 0.6,
        "acc_hm": pytest.approx(2 * 0.6 * 0.3 / 0.9),
    }
    assert derived(b2n, {"acc_global": 0.0, "acc_novel": 0.0})["acc_hm"] == 0.0
    # a round without one of the two (no client scored yet) has no harmonic mean, and only
    # base-to-novel has one
    assert derived(b2n, {"acc_novel": 0.3}) == derived(b2n, {"acc_global": 0.6}) == {}
    xd = Evaluation(mode="cross-dataset", targets=[{"name": "synthetic", "label": "s"}])
    assert derived(xd, {"acc_xd_a": 0.2, "acc_xd_b": 0.5, "acc_global": 0.9}) == {
        "acc_xd_mean": pytest.approx(0.35)
    }
    assert derived(xd, {"acc_global": 0.6, "acc_novel": 0.3}) == {}


def test_mode_settings_are_checked():
    with pytest.raises(ValueError, match="only for, mode 'cross-dataset'"):
        Evaluation(mode="cross-dataset")
    with pytest.raises(ValueError, match="only for, mode 'leave-one-domain-out'"):
        Evaluation(mode="base2novel", domain="d0")
    with pytest.raises(ValueError, match="only for, mode 'leave-one-domain-out'"):
        Evaluation(mode="leave-one-domain-out")
    with pytest.raises(ValueError, match="unique"):
        Evaluation(mode="cross-dataset", targets=[{"name": "synthetic"}, {"name": "synthetic"}])
    # a target's label defaults to its name
    assert Evaluation(mode="cross-dataset", targets=[{"name": "synthetic"}]).targets[0].label == (
        "synthetic"
    )


def _cell(method: dict, evaluation: dict | None, **data):
    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": "clip-test"},
            "dataset": {"num_classes": 5, "image_size": 16, "train_per_class": 6,
                        "test_per_class": 3, **data},
            "partition": {"num_clients": 3, "heldout_frac": 0.0},
            "train": {"rounds": 1, "batch_size": 8, "eval_batch_size": 64},
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "dirichlet", "alpha": 1.0, "min_size": 1}],
        "methods": [method],
    }  # fmt: skip
    if evaluation is not None:
        raw["defaults"]["evaluation"] = evaluation
    return expand_suite(raw, name="modes").cells[0]


def test_the_mode_is_part_of_the_run_key_and_absent_keeps_old_keys():
    plain = _cell({"name": "promptfl", "n_ctx": 4}, None)
    b2n = _cell({"name": "promptfl", "n_ctx": 4}, {"mode": "base2novel"})
    assert "evaluation" not in plain.identity()
    assert b2n.identity()["evaluation"]["mode"] == "base2novel"
    assert b2n.run_key != plain.run_key
    # cross-dataset targets are resolved with their dataset's defaults filled in
    xd = _cell({"name": "promptfl"}, {"mode": "cross-dataset", "targets": [{"name": "synthetic"}]})
    assert xd.evaluation.targets[0].args["num_classes"] == 20


def test_leave_one_domain_out_partitions_the_other_domains():
    lodo = {"mode": "leave-one-domain-out", "domain": "d1"}
    raw_part = {"name": "domain-dirichlet", "clients_per_domain": 2, "min_size": 1}
    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": "clip-test"},
            "dataset": {"num_classes": 4, "image_size": 16, "train_per_class": 6,
                        "test_per_class": 3, "num_domains": 3},
            "partition": {"num_clients": 4, "heldout_frac": 0.0},
            "train": {"rounds": 1, "batch_size": 8},
            "evaluation": lodo,
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [raw_part],
        "methods": [{"name": "promptfl", "n_ctx": 4}],
    }  # fmt: skip
    cfg = expand_suite(raw, name="lodo").cells[0]  # 4 clients = 2 x the 2 domains left
    task = build_task(cfg, CPU)
    assert task.data.domain_names == ["d0", "d2"]
    assert {c.domain for c in task.clients} == {0, 1}
    (held,) = task.eval_sets
    assert held.name == "lodo" and held.same_classes
    full = load_dataset(cfg.dataset)
    assert held.data.test_labels.tolist() == full.test_labels[full.test_domains == 1].tolist()
    assert len(task.data.test_labels) == int((full.test_domains != 1).sum())
    raw["defaults"]["partition"]["num_clients"] = 6  # the three domains: refused
    with pytest.raises(FpbenchError, match=r"clients_per_domain x domains \(2 x 2\)"):
        expand_suite(raw, name="lodo")


def _independent_accuracy(method, ctx, data):
    """Accuracy of CoOp prompts ctx (M, d) on `data`'s test split over its class names,
    computed from the backbone directly."""
    from fpbench.backbones.clip_prompts import PromptLayout

    clip = method.backbone
    with torch.no_grad():
        layout = PromptLayout.build(clip, list(data.class_names), ctx.shape[0])
        text = layout.text_features(clip, ctx.unsqueeze(0))[0]  # (C, E)
        feats = F.normalize(clip.encode_image(clip.preprocess(data.test_images)).float(), dim=-1)
        pred = (feats @ text.T).argmax(-1)
    return (pred == data.test_labels).float().mean().item()


def test_novel_classes_are_scored_with_the_trained_prompts_over_their_names():
    cfg = _cell({"name": "promptfl", "n_ctx": 4}, {"mode": "base2novel"})
    task = build_task(cfg, CPU)
    assert task.data.class_names == ["c0", "c1", "c2"]  # training sees the base classes only
    assert int(task.data.train_labels.max()) == 2
    (pop,) = build_populations(cfg, task, CPU)
    assert pop.method.task.class_names == ("c0", "c1", "c2")
    (target,) = pop.targets
    assert target.method.task.class_names == ("c3", "c4")
    server = pop.method.init_server(torch.Generator().manual_seed(3))
    out = score_targets(cell_of(cfg, task, [pop], [0, 1, 2], "fp32"), {"": server}, [0, 1, 2])
    novel = target.task.data
    assert len(novel.test_labels) == 2 * 3
    expected = _independent_accuracy(pop.method, server.params["ctx"], novel)
    assert out["acc_novel"] == pytest.approx(expected)
    assert set(out) == {"acc_novel", "ece_novel"}


def test_cross_dataset_scores_each_target_with_its_class_names():
    target = {"name": "synthetic", "label": "Other.Set", "args": {
        "num_classes": 7, "image_size": 16, "train_per_class": 1, "test_per_class": 2,
        "seed": 9}}  # fmt: skip
    cfg = _cell({"name": "promptfl", "n_ctx": 4}, {"mode": "cross-dataset", "targets": [target]})
    task = build_task(cfg, CPU)
    (pop,) = build_populations(cfg, task, CPU)
    server = pop.method.init_server(torch.Generator().manual_seed(4))
    out = score_targets(cell_of(cfg, task, [pop], [0, 1, 2], "fp32"), {"": server}, [0, 1, 2])
    data = pop.targets[0].task.data
    assert data.num_classes == 7 and len(data.test_labels) == 14
    expected = _independent_accuracy(pop.method, server.params["ctx"], data)
    assert out["acc_xd_other-set"] == pytest.approx(expected)


_FIVE = {"num_classes": 5, "image_size": 16, "train_per_class": 1, "test_per_class": 1}


@pytest.mark.parametrize(
    ("method", "evaluation"),
    [
        ({"name": "promptfl", "n_ctx": 4, "csc": True}, {"mode": "base2novel"}),
        ({"name": "fedvpt"}, {"mode": "cross-dataset", "targets": [{"name": "synthetic"}]}),
        # a target of as many classes as the run's: only the probe with one more class tells
        (
            {"name": "fedvpt"},
            {"mode": "cross-dataset", "targets": [{"name": "synthetic", "args": _FIVE}]},
        ),
        # an adapting method with a head: refused here, before its draw would be
        ({"name": "per-fedavg"}, {"mode": "cross-dataset", "targets": [{"name": "synthetic"}]}),
    ],
)
def test_a_method_whose_parameters_depend_on_the_classes_is_refused(method, evaluation):
    cfg = _cell(method, evaluation)
    if method["name"] in ("fedvpt", "per-fedavg"):
        cfg = cfg.model_copy(
            update={"backbone": cfg.backbone.model_copy(update={"name": "vit-test"})}
        )
    task = build_task(cfg, CPU)
    with pytest.raises(FpbenchError) as info:
        build_populations(cfg, task, CPU)
    assert str(info.value) == (
        f"method {method['name']} cannot be scored on other classes (evaluation mode "
        f"{evaluation['mode']}): its trained parameters depend on the number of classes "
        "(class-specific context or a classifier head); use a method that builds its "
        "classifier from the class names"
    )


_ADAPTING_SUITE = """
name = "adapting"
seeds = [0]
[defaults]
backbone = { name = "vit-test" }
partition = { num_clients = 4, heldout_frac = 0.0 }
train = { rounds = 1, batch_size = 8 }
evaluation = { mode = "leave-one-domain-out", domain = "d1" }
[defaults.dataset]
num_classes = 4
image_size = 16
train_per_class = 6
test_per_class = 3
num_domains = 3
[[datasets]]
name = "synthetic"
[[partitions]]
name = "domain-dirichlet"
clients_per_domain = 2
min_size = 1
[[methods]]
name = "per-fedavg"
"""


def test_a_method_that_adapts_on_client_data_is_refused_when_it_draws_in_the_mode(
    tmp_path, monkeypatch
):
    """Per-FedAvg draws each client's train data in its evaluation `client_params`; the held-out
    domain's clients have none there: `fpbench run` exits 2 with the reason on one line, and
    the run is stored as failed with it (not scored without its step)."""
    from typer.testing import CliRunner

    from fpbench.cli import app
    from fpbench.store import Store

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "no-data"))
    (tmp_path / "adapting.toml").write_text(_ADAPTING_SUITE)
    db = tmp_path / "r.db"
    args = ["run", "--suite", "adapting.toml", "--db", str(db), "--device", "cpu"]
    result = CliRunner().invoke(app, args)
    reason = (
        "method per-fedavg adapts on each client's data before it is scored; evaluation mode "
        "leave-one-domain-out scores clients without local data: use another method"
    )
    assert result.exit_code == 2, result.output
    assert reason in " ".join(result.output.split()) and "Traceback" not in result.output
    with Store(f"sqlite:///{db}") as store:
        (run,) = store.runs().itertuples()
        assert run.status == "failed" and reason in store.get_run(run.id).error


def test_a_task_without_local_data_refuses_the_draw_with_what_scores_it(tiny):
    """`scoring_task` names what scores its clients; a draw there raises that, before anything
    is loaded (a personal method that does not draw is scored as usual)."""
    from contextlib import ExitStack

    from fpbench.engine.evaluate import _draws
    from fpbench.engine.scoring import scoring_task

    _, task, method = tiny("per-fedavg")
    st = scoring_task(task.data, task, "evaluation mode base2novel")
    assert st.no_local_data == "evaluation mode base2novel" and task.no_local_data is None
    draw = _draws(method, st, None, torch.tensor([0, 1]), "fp32")(ExitStack())
    with pytest.raises(FpbenchError) as info:
        draw(3)
    assert str(info.value) == (
        "method per-fedavg adapts on each client's data before it is scored; evaluation mode "
        "base2novel scores clients without local data: use another method"
    )


_BAD_SUITE = """
name = "bad-mode"
seeds = [0]
[defaults]
backbone = {{ name = "clip-test" }}
dataset = {{ num_classes = 4, image_size = 16, train_per_class = 6, test_per_class = 3 }}
partition = {{ num_clients = 2, heldout_frac = 0.0 }}
train = {{ rounds = 1, batch_size = 8 }}
evaluation = {evaluation}
[[datasets]]
name = "synthetic"
[[partitions]]
name = "dirichlet"
min_size = 1
[[methods]]
name = "promptfl"
n_ctx = 4
"""


@pytest.mark.parametrize(
    ("evaluation", "needle"),
    [
        ('{ mode = "leave-one-domain-out", domain = "d9" }', "has no domain 'd9'"),
        ('{ mode = "cross-dataset", targets = [{ name = "dtd" }] }', "dataset 'dtd' not found"),
        ('{ mode = "cross-dataset", targets = [{ name = "nope" }] }', "nope"),
        ('{ mode = "base2novel", targets = [{ name = "dtd" }] }', "only for, mode 'cross-dataset'"),
    ],
)
def test_bad_modes_exit_2_with_one_line_and_write_nothing(
    tmp_path, monkeypatch, evaluation, needle
):
    from typer.testing import CliRunner

    from fpbench.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "no-data"))
    (tmp_path / "bad.toml").write_text(_BAD_SUITE.format(evaluation=evaluation))
    result = CliRunner().invoke(app, ["run", "--suite", str(tmp_path / "bad.toml")])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert not (tmp_path / "results").exists()


def test_a_personal_method_is_scored_with_each_trained_clients_own_prompts():
    from fpbench.methods.base import Context, as_logits

    cfg = _cell({"name": "fedotp", "n_ctx": 4}, {"mode": "base2novel"})
    task = build_task(cfg, CPU)
    (pop,) = build_populations(cfg, task, CPU)
    (target,) = pop.targets
    server = pop.method.init_server(torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)  # the clients' local prompts now differ
    server.personal = {
        k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in server.personal.items()
    }
    out = score_targets(
        cell_of(cfg, task, [pop], [0, 2], "fp32"), {"": server}, [0, 2]
    )  # client 1 never trained
    data = target.task.data
    x = pop.method.backbone.preprocess(data.test_images)
    rows = torch.zeros(len(x), dtype=torch.long)
    accs = []
    for c in (0, 2):
        params = pop.method.client_params(server, torch.tensor([c]), training=False)
        with torch.no_grad():
            logits = as_logits(target.method.forward(params, x, rows, Context(training=False)))
        accs.append((logits.argmax(-1) == data.test_labels).float().mean().item())
    assert out["acc_novel"] == pytest.approx(sum(accs) / 2)


def test_a_scoring_task_is_the_runs_clients_without_local_data_over_the_other_set(tiny):
    """`scoring_task` and `task_info`: the run's clients (sizes, held-out flags) with no local
    samples and uniform priors over the other set's classes; a method's view of it carries the
    set's data, and other class names (with no coarse groups) where given."""
    from fpbench.engine.scoring import scoring_task, task_info

    _, task, _ = tiny("promptfl")
    base, novel = class_split(task.data)
    novel = dataclasses.replace(novel, coarse_of_class=torch.tensor([4, 5, 6]))
    st = scoring_task(novel, task)
    n = task.num_clients
    assert st.data is novel and st.clients is task.clients
    assert st.train_sizes is task.train_sizes and st.heldout is task.heldout
    assert [t.tolist() for t in st.train_idx + st.test_idx] == [[]] * (2 * n)
    assert {t.dtype for t in st.train_idx + st.test_idx} == {torch.long}
    assert torch.equal(st.priors, torch.full((n, 3), 1 / 3))
    info = task_info(st)
    assert (info.num_classes, info.num_clients, info.class_names) == (
        3,
        n,
        tuple(novel.class_names),
    )
    assert torch.equal(info.class_priors, torch.full((n, 3), 1 / 3))
    assert info.dataset == novel.name and info.train_images is novel.train_images
    assert info.train_labels is novel.train_labels and info.coarse_of_class is novel.coarse_of_class
    assert info.train_sizes is task.train_sizes and info.heldout is task.heldout
    assert info.train_idx == tuple(st.train_idx)
    names = task_info(st, ["x", "y", "z", "w"])
    assert (names.num_classes, names.class_names) == (4, ("x", "y", "z", "w"))
    assert torch.equal(names.class_priors, torch.full((n, 4), 1 / 4))
    assert names.coarse_of_class is None


def test_a_run_stores_the_modes_scores_beside_its_own(tmp_path):
    """Through `run_cell`, a personal method's base-to-novel round stores `acc_novel` (over the
    clients trained so far), `acc_base` = `acc_global` and their harmonic mean."""
    from fpbench.engine.runner import run_cell
    from fpbench.store import Store

    cfg = _cell({"name": "fedotp", "n_ctx": 4}, {"mode": "base2novel"})
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"participation": 0.34})})
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
        rows = store.metrics()
    got = rows[rows["round"] == 0].set_index("name")["value"]
    base, novel = got["acc_global"], got["acc_novel"]
    assert "ece_novel" in got
    assert got["acc_base"] == base
    assert got["acc_hm"] == pytest.approx(2 * base * novel / (base + novel))


def test_score_targets_hands_evaluate_each_sets_method_task_inputs_and_the_precision(
    monkeypatch,
):
    """Each scored set is evaluated with its own method, task and inputs, the round's server,
    the run's eval batch size and the precision given (one population: every client).

    Catches the set's inputs or the precision not handed on (fresh inputs; fp32 whatever the
    run's)."""
    import fpbench.engine.rounds as rounds

    cfg = _cell({"name": "promptfl", "n_ctx": 4}, {"mode": "base2novel"})
    task = build_task(cfg, CPU)
    (pop,) = build_populations(cfg, task, CPU)
    server = pop.method.init_server(torch.Generator().manual_seed(4))
    calls, evaluate = [], rounds.evaluate

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(rounds, "evaluate", spy)
    out = score_targets(cell_of(cfg, task, [pop], [0, 1, 2], "bf16"), {"": server}, [0, 1, 2])
    ((args, kwargs),) = calls
    (target,) = pop.targets
    assert args[0] is target.method and args[1] is server and args[2] is target.task
    assert args[3:] == (64, target.inputs, "bf16") and kwargs == {"clients": None}
    assert set(out) == {"acc_novel", "ece_novel"}
