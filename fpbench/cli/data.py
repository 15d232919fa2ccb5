"""`fpbench data ...`: where the real datasets are, and preparing them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from fpbench.cli.apps import data_app
from fpbench.cli.common import console, err, parse_sets, user_errors, wrap
from fpbench.errors import FpbenchError

RootOpt = Annotated[
    Path | None,
    typer.Option("--root", help="data root (default: $FPBENCH_DATA, else ./data)"),
]
STYLE = {"prepared": "green", "raw": "yellow", "missing": "red", "built-in": "cyan"}


def dataset_rows(root: Path) -> list[tuple[str, str, str, str]]:
    """(name, state, where, what to do) for every registered dataset under `root`."""
    from fpbench.data.prepared import real_dataset
    from fpbench.registry import DATASETS

    rows = []
    for name in DATASETS.names():
        cls = real_dataset(name)
        if cls is None:
            rows.append((name, "built-in", "-", "generated on the fly"))
            continue
        s = cls.status(root)
        todo = {
            "prepared": "ready",
            "raw": f"ready (prepared on first use, or: fpbench data prepare {name})",
            "missing": s.hint,
        }[s.state]
        rows.append((name, s.state, str(s.where), todo))
    return rows


@data_app.command("status", short_help="Which datasets are present or missing, and where they go.")
@user_errors
def status(root: RootOpt = None) -> None:
    """Which datasets are present (prepared / raw files) or missing, and where they go."""
    from fpbench.data.prepared import data_root

    base = data_root(root)
    rows = dataset_rows(base)
    name_w, state_w, where_w = (max(len(r[i]) for r in rows) for i in range(3))
    longest_word = max(len(w) for r in rows for w in r[3].split())
    # the table where its "what to do" column gets 40 columns or its longest word (a URL, a
    # path), besides the others whole and the frame (13); else a block per dataset
    if console.width >= name_w + state_w + where_w + max(40, longest_word) + 13:
        table = Table(title=f"datasets under {base}")
        for col in ("dataset", "state", "where"):
            table.add_column(col, no_wrap=True)
        table.add_column("what to do", overflow="fold")
        for name, state, where, todo in rows:
            table.add_row(name, f"[{STYLE[state]}]{state}[/]", where, escape(todo))
        console.print(table)
        return
    console.print(f"datasets under {base}", highlight=False, markup=False, soft_wrap=True)
    for name, state, where, todo in rows:
        head = Text.assemble(
            name.ljust(name_w), "  ", (state.ljust(state_w), STYLE[state]), "  ", where
        )
        console.print(head, highlight=False, soft_wrap=True)
        for line in wrap(todo, console.width, indent="    "):
            console.print(line, highlight=False, markup=False, soft_wrap=True)


def _config(cls: Any, args: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    try:
        return cls.Config(**args)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "config"
        raise FpbenchError(f"--set {field}: {first['msg']} (dataset {cls.name!r})") from None


@data_app.command("prepare", short_help="Decode a dataset's files once into the prepared cache.")
@user_errors
def prepare(
    name: Annotated[str, typer.Argument(help="dataset name (see `fpbench data status`)")],
    root: RootOpt = None,
    download: Annotated[
        bool, typer.Option("--download", help="download the native files first if missing")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="prepare again even if cached")] = False,
    sets: Annotated[
        list[str] | None,
        typer.Option("--set", help="dataset config KEY=VALUE (repeatable), e.g. per_domain=1000"),
    ] = None,
) -> None:
    """Decode a dataset's native files once into the prepared uint8 cache (with progress)."""
    from fpbench.data.prepared import data_root, real_dataset

    cls = real_dataset(name)
    if cls is None:
        raise FpbenchError(f"dataset {name!r} is generated on the fly; nothing to prepare")
    cfg = _config(cls, parse_sets(sets))
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
    ) as bar:
        path = cls.prepare(
            cfg, data_root(root), download=download, force=force, progress=_progress(bar)
        )
    console.print(f"prepared {name}: {path}")


def _progress(bar: Progress) -> Callable[[str, int, int], None]:
    """A `Progress` callback that keeps one rich bar per description."""
    tasks: dict[str, Any] = {}

    def update(what: str, done: int, total: int) -> None:
        if what not in tasks:
            tasks[what] = bar.add_task(what, total=total)
        bar.update(tasks[what], completed=done, total=total)

    return update


@data_app.command(
    "generate-gpt-fl", short_help="Generate GPT-FL's synthetic images with a local model."
)
@user_errors
def generate_gpt_fl(
    name: Annotated[str, typer.Argument(help="dataset whose class names are drawn")],
    out: Annotated[Path, typer.Option("--out", help="folder for <class>/<i>.png")],
    model: Annotated[Path, typer.Option("--model", help="local diffusers text-to-image folder")],
    per_class: Annotated[int, typer.Option("--per-class", min=1, help="images per class")] = 100,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    steps: Annotated[int, typer.Option("--steps", min=1, help="denoising steps")] = 50,
    template: Annotated[
        str, typer.Option("--template", help="prompt, {} the class name")
    ] = "a photo of a {}.",
    guidance_scale: Annotated[
        float, typer.Option("--guidance-scale", min=0.0, help="classifier-free guidance")
    ] = 7.5,
    precision: Annotated[
        str, typer.Option("--precision", help="auto (fp16 on CUDA), fp16, fp32")
    ] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda")] = "auto",
    root: RootOpt = None,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="dataset config KEY=VALUE (repeatable)")
    ] = None,
) -> None:
    """Generate GPT-FL's synthetic training set (gpt-fl's synthetic_dir) with a local model.

    The settings go to <out>/generation.json, which gpt-fl's `generation` must match.
    """
    from fpbench.data.gpt_fl_generate import generate_images, require_text_to_image
    from fpbench.data.prepared import data_root
    from fpbench.registry import DATASETS

    require_text_to_image(model)
    cls = DATASETS.get(name)
    classes = cls.load(_config(cls, parse_sets(sets)), data_root(root)).class_names
    if precision not in ("auto", "fp16", "fp32"):
        raise FpbenchError(f"--precision {precision!r}: use auto, fp16 or fp32")
    written = generate_images(
        classes, out, model, per_class, seed=seed, steps=steps, template=template,
        guidance_scale=guidance_scale, precision=precision, device=device,
    )  # fmt: skip
    console.print(f"wrote {written} images for {len(classes)} classes to {out}")
