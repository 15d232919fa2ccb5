"""`fpbench report`: the HTML page from a fixture database, and its rendering in Chromium."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.errors import FpbenchError
from fpbench.report.html import Report, build_report, write_report
from fpbench.store import Store

PNG = b"\x89PNG\r\n\x1a\n"
SUITE = "rep"
# (method, partition, seed, final acc_global, device, torch version)
RUNS = [
    ("fedavg", "dir-0.3", 0, 0.70, "cpu (x86_64) (fp32)", "2.5.0"),
    ("fedavg", "dir-0.3", 1, 0.80, "cpu (x86_64) (fp32)", "2.5.0"),
    ("sgpt", "dir-0.3", 0, 0.85, "NVIDIA H200 (bf16)", "2.6.0+cu124"),
    ("sgpt", "path-s4", 0, 0.90, "NVIDIA H200 (bf16)", "2.6.0+cu124"),
]


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 runs; fedavg has no path-s4 cell; three evaluated rounds each with a `_last10` row."""
    path = tmp_path_factory.mktemp("db") / "rep.db"
    with Store(f"sqlite:///{path}") as store:
        for i, (method, part, seed, final, device, torch_v) in enumerate(RUNS):
            run = store.create_run(
                run_key=f"key{i:04d}{method}",
                suite=SUITE,
                method=method,
                dataset="synthetic",
                partition=part,
                seed=seed,
                config={},
                fpbench_version="0.1.0",
                torch_version=torch_v,
                device=device,
            )
            for r in range(3):
                acc = final - 0.1 * (2 - r)
                rows = [
                    (None, "acc_global", acc, None),
                    (None, "acc_local_worst", acc / 2, None),
                    (None, "loss_train", 2.0 - r, None),
                ]
                if r == 2:
                    rows += [(None, "acc_global_last10", final, None)]
                    rows += [(None, "acc_local_worst_last10", final / 2, None)]
                    rows += [(None, "acc_domain_real-world", final - 0.05, None)]
                store.write_round(
                    run.id, r, loss_train=2.0 - r, wall_s=1.0, bytes_up=10, bytes_down=10,
                    metrics=rows,
                )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def report(db: Path) -> Report:
    """The page is built once: each build draws five figures."""
    with Store(f"sqlite:///{db}") as store:
        return build_report(store.metrics(suite=SUITE), store.runs(suite=SUITE), SUITE)


class _Tags(HTMLParser):
    """Collects tags (with attributes) and the text of the cells of each table."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.tables: list[list[str]] = []  # cell texts per table
        self._in_cell = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "table":
            self.tables.append([])
        self._in_cell = tag in ("td", "th")
        if self._in_cell:
            self.tables[-1].append("")

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data):
        if self._in_cell:
            self.tables[-1][-1] += data.strip()


def _parse(text: str) -> _Tags:
    parser = _Tags()
    parser.feed(text)
    return parser


def test_header_names_runs_versions_and_devices(report):
    page = report.html
    assert "fpbench report: suite rep" in page
    for i, (method, *_rest) in enumerate(RUNS):
        assert f"key{i:04d}{method}" in page
    assert "torch: 2.5.0, 2.6.0+cu124" in page
    assert "devices: cpu (x86_64) (fp32), NVIDIA H200 (bf16)" in page
    assert "fpbench: 0.1.0" in page
    assert "from 4 runs (4 pending)" in page


def test_summary_tables_values_std_and_missing_cell(report):
    parsed = _parse(report.html)
    classes = [a.get("class", "") for t, a in parsed.tags if t == "table"]
    # runs table, then acc_global, acc_local_worst and the per-domain metric (no other is stored)
    assert classes == ["dataframe runs"] + ["dataframe summary"] * 3
    _, glob, worst, domain = parsed.tables
    assert "synthetic / dir-0.3" in glob and "synthetic / path-s4" in glob
    # fedavg on dir-0.3: mean(70, 80) = 75, sample std = 7.07; on path-s4: no run
    row = glob.index("fedavg")
    # with the 95% t-interval: 75 ± t(0.975, 1) 12.706 * 7.07 / sqrt(2) = 75 ± 63.53
    assert glob[row + 1 : row + 3] == ["75.00 ± 7.07 [11.47, 138.53]", "-"]
    row = glob.index("sgpt")
    assert glob[row + 1 : row + 3] == ["85.00", "90.00"]
    row = worst.index("fedavg")
    assert worst[row + 1 : row + 3] == ["37.50 ± 3.54 [5.73, 69.27]", "-"]  # halves of the above
    row = domain.index("fedavg")
    assert domain[row + 1 : row + 3] == ["70.00 ± 7.07 [6.47, 133.53]", "-"]  # final - 5 points
    assert "acc domain real-world (%)" in report.html


def test_plots_are_embedded_pngs_and_written_beside_the_page(report, tmp_path):
    # tradeoff + curves of acc_global, acc_local_worst, loss_train (acc_local_mean not stored)
    expected = ["tradeoff.png", "curves-acc_global.png", "curves-acc_local_worst.png"]
    assert sorted(report.images) == sorted([*expected, "curves-loss_train.png"])
    srcs = [a["src"] for t, a in _parse(report.html).tags if t == "img"]
    assert len(srcs) == 4
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    assert 'src="http' not in report.html and "<link" not in report.html  # self-contained
    page = write_report(report, tmp_path / "out")
    assert page.read_text(encoding="utf-8") == report.html
    for name, data in report.images.items():
        assert (tmp_path / "out" / name).read_bytes() == data


def test_empty_suite_is_a_user_error(db):
    with Store(f"sqlite:///{db}") as store, pytest.raises(FpbenchError, match="--suite nope"):
        build_report(store.metrics(suite="nope"), store.runs(suite="nope"), "nope")


def test_cli_report(db, tmp_path):
    out = tmp_path / "site"
    result = CliRunner().invoke(
        app, ["report", "--suite", SUITE, "--out", str(out), "--db", str(db)]
    )
    assert result.exit_code == 0, result.output
    assert "75.00 ± 7.07" in (out / "index.html").read_text(encoding="utf-8")
    assert (out / "tradeoff.png").read_bytes().startswith(PNG)
    missing = CliRunner().invoke(
        app, ["report", "--suite", SUITE, "--out", str(out), "--db", str(tmp_path / "no.db")]
    )
    assert missing.exit_code == 2
    assert "no results database" in missing.output


CHROMIUM = shutil.which("chromium")


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium not found on PATH (Debian: apt-get install -y chromium)",
)
def test_report_renders_in_headless_chromium(report, tmp_path):
    page = write_report(report, tmp_path / "site")
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
    ]  # fmt: skip
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert re.search(r'<table[^>]*class="dataframe summary"', dom)
    assert "75.00 ± 7.07" in dom
    assert dom.count("data:image/png;base64,") == 4
    shot = tmp_path / "shot.png"
    subprocess.run(
        [CHROMIUM, *flags, "--window-size=1280,2000", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    assert shot.read_bytes().startswith(PNG)


def test_counts_print_as_integers_under_one_header_row(db):
    """params_trainable 2580, not 2580.00; the `method` label heads the first column."""
    from fpbench.report.html import _tables

    with Store(f"sqlite:///{db}") as store:
        frame = store.metrics(suite=SUITE)
    counts = frame[frame["name"] == "acc_global"].copy()
    counts["name"] = "params_trainable"
    counts["value"] = counts["method"].map({"fedavg": 1290.0, "sgpt": 2580.0})
    html_tables = _tables(pd.concat([frame, counts], ignore_index=True), SUITE)
    page = "\n".join(html_tables)
    heading = next(i for i, part in enumerate(html_tables) if "param" in part.lower())
    last = _parse(html_tables[heading + 1]).tables[0]
    assert last[:3] == ["method", "synthetic / dir-0.3", "synthetic / path-s4"]
    assert last[3:] == ["fedavg", "1290 ± 0 [1290, 1290]", "-", "sgpt", "2580", "2580"]
    for table in re.findall(r"<thead>.*?</thead>", page, flags=re.S):
        assert table.count("<tr") == 1  # no second header row holding only `method`
