"""The offline twins of the evaluation-mode and FLiP suites, end to end through the CLI: each
stores the metrics its mode defines, with values that follow from each other."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict

import pytest
from typer.testing import CliRunner

from fpbench.cli import app


def _run(suite: str, tmp_path, monkeypatch) -> dict[str, dict]:
    """Run a shipped suite; per method / dataset label: its config, round aggregates
    {round: {name: value}} and per-client rows [(round, client, name, value, count)]."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--suite", suite])
    assert result.exit_code == 0, result.output
    out: dict[str, dict] = {}
    with sqlite3.connect(tmp_path / "results" / "fpbench.db") as con:
        runs = con.execute("select id, method, dataset, status, config_json from runs").fetchall()
        for run_id, method, dataset, status, config in runs:
            assert status == "done"
            agg: dict[int, dict[str, float]] = defaultdict(dict)
            per_client = []
            for r, client, name, value, count in con.execute(
                "select m.round, m.client_id, m.name, m.value, m.count from metrics m "
                "where m.run_id = ?",
                (run_id,),
            ):
                if client is None:
                    agg[r][name] = value
                else:
                    per_client.append((r, client, name, value, count))
            out[f"{method}/{dataset}"] = {
                "config": json.loads(config),
                "agg": agg,
                "clients": per_client,
            }
    return out


def _integral(acc: float, n: int) -> bool:
    return abs(acc * n - round(acc * n)) < 1e-4


def test_smoke_clip_base2novel(tmp_path, monkeypatch):
    runs = _run("smoke-clip-base2novel", tmp_path, monkeypatch)
    labels = [
        "coop",
        "fedotp",
        "zero-shot",
        "cocoop",
        "kgcoop",
        "prograd",
        "fedtpg",
        "maple",
        "promptsrc",
    ]
    assert set(runs) == {f"{label}/synthetic" for label in labels}
    for run in runs.values():
        assert run["config"]["evaluation"]["mode"] == "base2novel"
        assert set(run["agg"]) == {0, 1}  # loss every round, evaluation at the last
        agg = run["agg"][1]
        base, novel = agg["acc_base"], agg["acc_novel"]
        assert base == agg["acc_global"]
        assert agg["acc_hm"] == pytest.approx(2 * base * novel / (base + novel))
        assert 0 <= agg["ece_novel"] <= 1 and "ece_global" in agg
        assert {"acc_hm_last1", "acc_novel_last1", "ece_novel_last1"} <= set(run["agg"][1])
    # a global model's novel accuracy is a count over the 3 novel classes x 2 test images
    assert _integral(runs["coop/synthetic"]["agg"][1]["acc_novel"], 6)
    # per-client calibration beside per-client accuracy (4 clients, each with a local test set)
    rows = runs["coop/synthetic"]["clients"]
    assert sorted(c for r, c, n, *_ in rows if r == 1 and n == "ece_local") == [0, 1, 2, 3]


def test_smoke_clip_xdataset(tmp_path, monkeypatch):
    runs = _run("smoke-clip-xdataset", tmp_path, monkeypatch)
    assert set(runs) == {"coop/synthetic", "fedotp/synthetic"}
    for run in runs.values():
        targets = run["config"]["evaluation"]["targets"]
        assert [t["label"] for t in targets] == ["syn-a", "syn-b"]
        agg = run["agg"][1]
        a, b = agg["acc_xd_syn-a"], agg["acc_xd_syn-b"]
        assert agg["acc_xd_mean"] == pytest.approx((a + b) / 2)
        assert {"ece_xd_syn-a", "ece_xd_syn-b", "acc_xd_mean_last1"} <= set(agg)
    agg = runs["coop/synthetic"]["agg"][1]  # the global prompt: counts over 4 x 3 and 8 x 2 images
    assert _integral(agg["acc_xd_syn-a"], 12) and _integral(agg["acc_xd_syn-b"], 16)


def test_smoke_clip_lodo(tmp_path, monkeypatch):
    runs = _run("smoke-clip-lodo", tmp_path, monkeypatch)
    assert set(runs) == {"coop/synthetic-no-d0", "coop/synthetic-no-d2"}
    for held, trained in (("d0", {"d1", "d2"}), ("d2", {"d0", "d1"})):
        run = runs[f"coop/synthetic-no-{held}"]
        assert run["config"]["evaluation"] == {
            "mode": "leave-one-domain-out", "domain": held, "targets": []
        }  # fmt: skip
        agg = run["agg"][1]
        domains = {n.removeprefix("acc_domain_") for n in agg if n.startswith("acc_domain_")}
        assert {d for d in domains if not d.endswith("_last1")} == trained
        # the held-out domain: 6 classes x 1 test image each (3 per class over 3 domains)
        assert _integral(agg["acc_lodo"], 6) and "ece_lodo" in agg and "acc_lodo_last1" in agg


def test_smoke_flip_compare(tmp_path, monkeypatch):
    runs = _run("smoke-flip-compare", tmp_path, monkeypatch)
    labels = "coop fedotp local zero-shot centralized cocoop kgcoop prograd plot proda bpl fedclip"
    labels = (*labels.split(), "fedpgp", "promptfolio", "fedtpg", "dp-fpl", "pfedmoap", "fedpha",
              "maple", "promptsrc", "fedmvp")  # fmt: skip
    assert set(runs) == {f"{label}/synthetic" for label in labels}
    for run in runs.values():  # every method of the twin stores both settings' metrics
        both = {"acc_global", "acc_local_mean", "ece_global", "ece_local_mean"}
        assert both <= set(run["agg"][1])
    for key, run in ((k, runs[k]) for k in ("coop/synthetic", "fedotp/synthetic")):
        cfg = run["config"]
        assert cfg["partition"]["args"]["num_clients"] == 10
        assert cfg["partition"]["args"]["alpha"] == 0.1 and cfg["partition"]["args"]["shots"] == 8
        assert "evaluation" not in cfg or cfg["evaluation"] is None
        agg = run["agg"][1]
        # the global setting's and the personal setting's metrics, each with its calibration
        assert {"acc_global", "acc_local_mean", "ece_global", "ece_local_mean"} <= set(agg)
        local = [v for r, _, n, v, _ in run["clients"] if r == 1 and n == "ece_local"]
        assert agg["ece_local_mean"] == pytest.approx(sum(local) / len(local))
        glob = [v for r, _, n, v, _ in run["clients"] if r == 1 and n == "ece_global"]
        if key.startswith("fedotp"):  # personal: each client's own model on the test split
            assert agg["ece_global"] == pytest.approx(sum(glob) / len(glob)) and glob
        else:
            assert glob == []
