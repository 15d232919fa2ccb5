"""The HTML report page piece by piece: header, runs table, summary tables, plots, the page itself.

Hand-built frames shaped like `Store.metrics()` / `Store.runs()` (no database) and as few drawn
figures as the checks need, so the whole file runs in a few seconds.
"""

from __future__ import annotations

import base64
import datetime as dt
import locale
import re
import struct
import time
from html.parser import HTMLParser

import matplotlib
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fpbench.errors import FpbenchError
from fpbench.report import html as page_mod
from fpbench.report import plots
from fpbench.report.html import Report, build_report, write_report

NOW = dt.datetime(2026, 1, 2, 3, 4, 59, tzinfo=dt.UTC)
INTRO = (
    '<p class="meta">Mean ± std over seeds of each run&#x27;s final value (the mean over the last '
    "evaluated rounds), then in brackets the 95% confidence interval of the mean over seeds "
    "(Student t, two or more seeds); accuracies in percent; unfinished runs left out.</p>"
)


def _metrics(rows: list[tuple]) -> pd.DataFrame:
    """(run_id, method, seed, round, name, value) rows on cifar100 / dir."""
    records = [
        {"run_id": r, "suite": "s", "method": m, "dataset": "cifar100", "partition": "dir",
         "seed": seed, "round": rnd, "client_id": None, "name": n, "value": v, "count": None}
        for r, m, seed, rnd, n, v in rows
    ]  # fmt: skip
    columns = ["run_id", "suite", "method", "dataset", "partition", "seed", "round", "client_id"]
    frame = pd.DataFrame(records, columns=[*columns, "name", "value", "count"])
    return frame.astype({"client_id": "Int64", "count": "Int64"})


def _runs(rows: list[dict]) -> pd.DataFrame:
    """Runs shaped like `Store.runs()`: the given fields over defaults."""
    base = {
        "id": 1, "run_key": "k", "suite": "s", "method": "fedavg", "dataset": "cifar100",
        "partition": "dir", "seed": 0, "status": "done", "error": None, "created_at": None,
        "finished_at": None, "wall_s": None, "fpbench_version": "0.1", "torch_version": "2.5",
        "device": "cpu", "peak_mem_bytes": None, "round_flops": None, "last_round": 1,
    }  # fmt: skip
    frame = pd.DataFrame([{**base, **row} for row in rows], columns=list(base))
    return frame.astype({"last_round": "Int64"})


class _Page(HTMLParser):
    """Tags with attributes, texts of h1/h2/h3/li/p/figcaption, and each table's rows of cells."""

    TEXT = ("h1", "h2", "h3", "li", "p", "figcaption", "summary", "title", "style")

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.texts: list[tuple[str, str]] = []
        self.tables: list[list[list[str]]] = []
        self._open: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][-1].append("")
        if tag in (*self.TEXT, "td", "th"):
            self._open = tag
            if tag in self.TEXT:
                self.texts.append((tag, ""))

    def handle_endtag(self, tag):
        if tag == self._open:
            self._open = None

    def handle_data(self, data):
        if self._open in ("td", "th"):
            self.tables[-1][-1][-1] += data.strip()
        elif self._open:
            tag, text = self.texts[-1]
            self.texts[-1] = (tag, text + data)


# -- header and runs table ----------------------------------------------------------------------


def test_header_provenance_counts_and_runs_table():
    runs = _runs([
        {"id": 1, "fpbench_version": "0.1", "device": "cpu & <gpu>"},
        {"id": 2, "status": "failed", "fpbench_version": None, "torch_version": "2.6"},
        {"id": 3, "fpbench_version": "0.2", "device": "cpu & <gpu>"},
    ])  # fmt: skip
    text = page_mod._header(runs, "a<b", NOW)
    lines = text.split("\n")
    assert lines[:8] == [
        "<h1>fpbench report: suite a&lt;b</h1>",
        '<p class="meta">generated 2026-01-02 03:04 UTC from 3 runs (2 done, 1 failed)</p>',
        '<ul class="provenance">',
        "<li>fpbench: 0.1, 0.2</li>",  # first-seen order, a missing one left out
        "<li>torch: 2.5, 2.6</li>",
        "<li>devices: cpu &amp; &lt;gpu&gt;, cpu</li>",
        "</ul>",
        "<details open><summary>Runs</summary>",
    ]
    assert text == "\n".join([*lines[:8], page_mod._runs_table(runs), "</details>"])
    one = page_mod._header(runs.iloc[:1], "s", NOW).split("\n")[1]
    assert one == '<p class="meta">generated 2026-01-02 03:04 UTC from 1 run (1 done)</p>'
    none = page_mod._header(runs.iloc[:0], "s", NOW).split("\n")
    assert none[1] == '<p class="meta">generated 2026-01-02 03:04 UTC from 0 runs (none)</p>'
    assert none[3:6] == ["<li>fpbench: unknown</li>", "<li>torch: unknown</li>",
                         "<li>devices: unknown</li>"]  # fmt: skip
    bare = page_mod._header(runs.drop(columns=["device"]), "s", NOW).split("\n")
    assert bare[5] == "<li>devices: unknown</li>"


def test_runs_table_columns_rounds_costs_and_escaping():
    runs = _runs([
        {"id": 7, "run_key": "abc", "method": "<x>", "seed": 1, "wall_s": 12.34,
         "peak_mem_bytes": 1536, "round_flops": 2.5e12, "last_round": 2, "device": "cuda"},
        {"id": 8, "run_key": "def", "status": "pending", "last_round": None, "torch_version": None},
    ])  # fmt: skip
    runs = runs[list(reversed(runs.columns))]  # the table's column order is its own
    text = page_mod._runs_table(runs)
    assert text.startswith('<table class="dataframe runs">')
    assert "&lt;x&gt;" in text
    (table,) = _Page(text).tables
    assert table == [
        ["id", "run_key", "method", "dataset", "partition", "seed", "status", "rounds", "wall_s",
         "peak memory", "FLOPs / round", "fpbench_version", "torch_version", "device"],
        ["7", "abc", "<x>", "cifar100", "dir", "1", "done", "3", "12.3", "1.50 KiB",
         "2.50 TFLOP", "0.1", "2.5", "cuda"],
        ["8", "def", "fedavg", "cifar100", "dir", "0", "pending", "0", "", "", "", "0.1", "",
         "cpu"],
    ]  # fmt: skip
    # without `last_round` (not from the store) there is no rounds column
    (bare,) = _Page(page_mod._runs_table(runs.drop(columns=["last_round"]))).tables
    assert "rounds" not in bare[0] and len(bare[0]) == 13


# -- summary tables --------------------------------------------------------------------------


def test_tables_per_metric_with_headings_and_seed_notes():
    metrics = _metrics([
        (1, "fedavg", 0, 1, "acc_global", 0.7), (2, "fedavg", 1, 1, "acc_global", 0.8),
        (1, "fedavg", 0, 1, "acc_local_worst_last10", 0.3),  # only the summary row stored
        (1, "fedavg", 0, 1, "acc_domain_b-x", 0.5), (1, "fedavg", 0, 1, "acc_domain_a", 0.25),
        (1, "fedavg", 0, 1, "acc_domain_Bad", 0.1), (1, "fedavg", 0, 1, "foo", 1.0),
    ])  # fmt: skip
    parts = page_mod._tables(metrics, "s")
    assert len(parts) == 12  # heading, table, note per metric
    assert parts[0::3] == [
        "<h3>global accuracy (%)</h3>", "<h3>worst local accuracy (%)</h3>",
        "<h3>acc domain a (%)</h3>", "<h3>acc domain b-x (%)</h3>",
    ]  # fmt: skip
    assert parts[2::3] == [
        '<p class="meta">each cell: mean ± std over 2 seeds</p>',
        *['<p class="meta">each cell: mean ± std over 1 seed</p>'] * 3,
    ]
    assert all(p.startswith('<table class="dataframe summary">') for p in parts[1::3])
    tables = [_Page(p).tables[0] for p in parts[1::3]]
    assert tables[0] == [["method", "cifar100 / dir"], ["fedavg", "75.00 ± 7.07 [11.47, 138.53]"]]
    assert [t[1] for t in tables[1:]] == [["fedavg", "30.00"], ["fedavg", "25.00"],
                                          ["fedavg", "50.00"]]  # fmt: skip
    assert page_mod._tables(_metrics([(1, "a", 0, 1, "foo", 1.0)]), "s") == [
        '<p class="missing">no summary metrics stored</p>'
    ]


# -- plots ------------------------------------------------------------------------------------


def test_plot_specs_names_captions_and_builders():
    metrics = _metrics([
        (1, "fedavg", 0, 1, "loss_train", 1.0), (1, "fedavg", 0, 1, "acc_global", 0.5),
        (1, "fedavg", 0, 1, "acc_local_mean", 0.4), (1, "fedavg", 0, 1, "acc_local_worst", 0.2),
    ])  # fmt: skip
    worst = "Worst local accuracy (%) against round, mean over seeds."
    specs = page_mod._plot_specs(metrics, "s")
    assert [(name, caption) for name, caption, _ in specs] == [
        ("tradeoff.png",
         "Global accuracy vs worst local accuracy, one marker per method (SGPT Fig. 1)."),
        ("curves-acc_global.png", "Global accuracy (%) against round, mean over seeds."),
        ("curves-acc_local_mean.png", "Mean local accuracy (%) against round, mean over seeds."),
        ("curves-acc_local_worst.png", worst),
        ("curves-loss_train.png", "Training loss against round, mean over seeds."),
    ]  # fmt: skip
    titles = [build().get_suptitle() for _, _, build in specs]
    assert titles == [
        "worst local accuracy vs global accuracy\nsuite s", "global accuracy per round\nsuite s",
        "mean local accuracy per round\nsuite s", "worst local accuracy per round\nsuite s",
        "training loss per round\nsuite s",
    ]  # fmt: skip


def _png_size_and_dpi(png: bytes) -> tuple[int, int, int]:
    """(width, height) from IHDR and the pixels per metre of pHYs."""
    width, height = struct.unpack(">II", png[16:24])
    at = png.index(b"pHYs")
    return width, height, struct.unpack(">I", png[at + 4 : at + 8])[0]


def test_png_is_110_dpi_cropped_to_the_drawing():
    fig = Figure(figsize=(4, 2))
    FigureCanvasAgg(fig)
    fig.text(0.5, 0.5, "x")
    with matplotlib.rc_context({"savefig.format": "svg"}):  # a user's matplotlibrc
        png = page_mod._png(fig)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height, ppm = _png_size_and_dpi(png)
    assert ppm == round(110 / 0.0254)  # 110 dpi
    assert width < 4 * 110 and height < 2 * 110  # tight: a letter and its padding, not 440x220


def test_figures_embed_pngs_and_say_why_one_is_not_drawn():
    metrics = _metrics(
        [(1, "fedavg", 0, 0, "acc_global", 0.5), (1, "fedavg", 0, 1, "acc_global", 0.6)]
    )
    images: dict[str, bytes] = {}
    parts = page_mod._figures(metrics, "s<1>", images)
    assert parts[0] == (
        '<p class="missing">tradeoff.png: not drawn: no run has both &#x27;acc_global&#x27; and '
        "&#x27;acc_local_worst&#x27;; pick other metrics with --x/--y</p>"
    )
    assert list(images) == ["curves-acc_global.png"]
    png = images["curves-acc_global.png"]
    assert png == page_mod._png(plots.curves(metrics, "acc_global", suite="s<1>"))
    assert _png_size_and_dpi(png)[2] == round(110 / 0.0254)
    caption = "Global accuracy (%) against round, mean over seeds."
    data = base64.b64encode(png).decode("ascii")
    assert parts[1:] == [
        f'<figure><img src="data:image/png;base64,{data}" alt="{caption}">'
        f"<figcaption>{caption} (curves-acc_global.png)</figcaption></figure>"
    ]


# -- the page ---------------------------------------------------------------------------------


def test_page_head_body_order_and_left_out_runs():
    metrics = _metrics([
        (1, "fedavg", 0, 0, "acc_hm", 0.5), (2, "fedavg", 1, 0, "acc_hm", 0.7),
        (3, "sgpt", 0, 0, "acc_hm", 0.1),  # still running: left out
    ])  # fmt: skip
    runs = _runs([{"id": 1}, {"id": 2, "seed": 1},
                  {"id": 3, "method": "sgpt", "status": "running", "last_round": 0}])  # fmt: skip
    report = build_report(metrics, runs, "a<b", now=NOW)
    assert report.images == {}  # no curve metric; the trade-off has no rows
    head = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        "<title>fpbench report: suite a&lt;b</title>\n<style>" + page_mod.CSS + "</style>\n"
        "</head>\n<body>\n"
    )
    assert report.html.startswith(head) and report.html.endswith("\n</body>\n</html>\n")
    body = report.html[len(head) : -len("\n</body>\n</html>\n")].split("\n")
    header = page_mod._header(runs, "a<b", NOW).split("\n")
    assert body[: len(header)] == header
    rest = body[len(header) :]
    assert rest[:3] == [
        "<h2>Summary tables</h2>",
        INTRO,
        '<p class="missing">left out 1 unfinished run: sgpt / cifar100 / dir / seed 0 (running, '
        "stored up to round 1)</p>",
    ]
    assert rest[3] == "<h3>base-novel harmonic mean (%)</h3>"
    tail = rest[rest.index("<h2>Plots</h2>") :]
    assert tail == [
        "<h2>Plots</h2>",
        '<div class="plots">',
        '<p class="missing">tradeoff.png: not drawn: no rows for metrics [&#x27;acc_global&#x27;, '
        "&#x27;acc_local_worst&#x27;]; stored metrics: acc_hm</p>",
        "</div>",
    ]
    cells = _Page(report.html).tables[1]
    assert cells[1] == ["fedavg", "60.00 ± 14.14 [-67.06, 187.06]"]  # sgpt's rows left out
    assert [t for t in _Page(report.html).texts if t[0] == "h2"] == [
        ("h2", "Summary tables"), ("h2", "Plots")
    ]  # fmt: skip


def test_page_without_unfinished_runs_and_with_the_current_time(monkeypatch):
    metrics = _metrics([(1, "fedavg", 0, 0, "acc_global", 0.5)])
    monkeypatch.setenv("TZ", "Asia/Tokyo")  # UTC+9: the page still says UTC time
    time.tzset()
    try:
        before = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
        report = build_report(metrics, _runs([{"id": 1}]), "s")
        after = dt.datetime.now(dt.UTC)
    finally:
        monkeypatch.undo()
        time.tzset()
    text = report.html
    # the one figure is the suite's curve (its title names the suite), also kept for writing
    curve = page_mod._png(plots.curves(metrics, "acc_global", suite="s"))
    assert report.images == {"curves-acc_global.png": curve}
    stamp = re.search(r"generated (\S+ \S+) UTC", text).group(1)
    when = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M").replace(tzinfo=dt.UTC)
    assert before <= when <= after
    assert 'class="missing">left out' not in text
    assert "<h2>Summary tables</h2>\n" + INTRO + "\n<h3>" in text


def test_page_errors_name_the_suite_and_the_unfinished_runs():
    with pytest.raises(FpbenchError) as err:
        build_report(_metrics([]), _runs([]), "s")
    assert str(err.value) == "no results for suite s; run `fpbench run --suite s` first"
    metrics = _metrics([(3, "sgpt", 0, 0, "acc_hm", 0.1)])
    runs = _runs([{"id": 3, "method": "sgpt", "status": "failed", "last_round": 0}])
    with pytest.raises(FpbenchError) as err:
        build_report(metrics, runs, "s")
    assert str(err.value) == (
        "no finished runs of suite s yet (left out 1 unfinished run: sgpt / cifar100 / dir / "
        "seed 0 (failed, stored up to round 1))"
    )


def test_write_report_creates_folders_and_writes_utf8(tmp_path):
    report = Report("<p>± é</p>", {"a.png": b"1", "b.png": b"22"})
    out = tmp_path / "x" / "y"
    page = write_report(report, out)
    assert page == out / "index.html"
    assert page.read_bytes() == "<p>± é</p>".encode()
    assert (out / "a.png").read_bytes() == b"1" and (out / "b.png").read_bytes() == b"22"
    assert write_report(Report("again"), out).read_text(encoding="utf-8") == "again"  # exists
    ctype = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")  # an ASCII locale: UTF-8 all the same
    try:
        write_report(Report("± é"), out)
    finally:
        locale.setlocale(locale.LC_CTYPE, ctype)
    assert (out / "index.html").read_bytes() == "± é".encode()
    assert sorted(p.name for p in out.iterdir()) == ["a.png", "b.png", "index.html"]
