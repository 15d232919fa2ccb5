"""The device-hours of every paper's suites, measured in one budgeted process.

Every suite that a shipped paper table reads is planned (`fpbench.measure.estimate.plan`); the
cost groups of all of them (`cost_group`) are measured once each with `estimate(batches=N)`,
on the method settings that most of a group's cells use (`representatives`), the suites taking
turns, each with its group of the most cells, until the budget is spent; then each suite and
each paper is projected from those measurements. A suite read by two papers counts in both
papers' figures and once in the total. Cells whose group was not measured in time are counted
apart, and an extrapolated figure gives them the mean cost per cell of their suite's measured
cells.

    python scripts/gpu/paper_costs.py --device cuda --budget-s 300 --json costs.json
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter
from typing import Any

import torch

from fpbench.measure.estimate import Memo, as_dict, cost_group, estimate, plan, representatives
from fpbench.report.paper import list_papers, load_paper
from fpbench.suites import load_suite


def paper_suites(name: str) -> list[str]:
    """The suites a paper's tables read (a cell's own `suite` included), in table order: the
    main tables' suites first, whose method settings a cost group is timed on in a tie."""
    paper = load_paper(name)
    found = [t.spec(r, c).get("suite") for t in paper.tables for r in t.rows for c in t.columns]
    return list(dict.fromkeys(s for s in found if isinstance(s, str) and not s.startswith("!")))


def in_turn(groups_of: dict[str, set], cells: Counter) -> list[tuple]:
    """Every group once, the suites taking turns, each giving its group of the most cells."""
    order: list[tuple] = []
    left = [sorted(g, key=lambda k: (-cells[k], k)) for g in groups_of.values()]
    while any(left):
        for queue in left:
            while queue and queue[0] in order:
                queue.pop(0)
            if queue:
                order.append(queue.pop(0))
    return order


def _h(hours: float | None) -> str:
    return "-" if hours is None else f"{hours:.2f}"


def extrapolated(v: dict[str, Any]) -> float | None:
    """A suite's device-hours with its unmeasured cells at its measured mean per cell."""
    if not v["cells_measured"]:
        return None
    return v["device_hours"] * v["cells"] / v["cells_measured"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--scaled", type=int, default=1, help="batches a client, as estimate --scaled")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop measuring after this")
    ap.add_argument("--group-cap-s", type=float, default=30.0, help="give up on a group after")
    ap.add_argument("--papers", nargs="*", default=None, help="default: every shipped paper")
    ap.add_argument("--json", default=None, help="write every estimate and the sums here")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.budget_s

    def over(signum, frame):
        raise TimeoutError(f"over --group-cap-s {args.group_cap_s:g} s")

    signal.signal(signal.SIGALRM, over)
    device = torch.device(args.device)

    papers = {p: paper_suites(p) for p in (args.papers or list_papers())}
    suites = {s: load_suite(s) for v in papers.values() for s in v}  # table order, each once
    cells: Counter = Counter()  # cells of every suite per cost group
    planned, suite_of, groups_of = [], {}, {}
    for name, suite in suites.items():
        for shape, cfg, n in plan(suite):
            cells[cost_group(shape)] += n
            planned.append((shape, cfg, n))
            suite_of.setdefault(id(cfg), suite)
            groups_of.setdefault(name, set()).add(cost_group(shape))
    timed_as = representatives(planned)  # each group's most used method settings
    print(
        f"{len(papers)} papers, {len(suites)} suites, {sum(cells.values())} cells, "
        f"{len(cells)} cost groups",
        flush=True,
    )

    memo, start = Memo(), time.monotonic()
    for i, group in enumerate(in_turn(groups_of, cells)):
        n = cells[group]
        if time.monotonic() > deadline:
            break
        cfg = timed_as[group][1]
        one = suite_of[id(cfg)].model_copy(update={"cells": (cfg,)})
        signal.setitimer(signal.ITIMER_REAL, args.group_cap_s)  # a group that hangs is cut
        try:
            estimate(one, device, args.precision, batches=args.scaled, memo=memo)
        except TimeoutError as e:  # raised outside the measurement itself
            memo.groups[group] = f"TimeoutError: {e}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        found = memo.groups.get(group)
        what = found if isinstance(found, str) else "ok"
        print(
            f"[{time.monotonic() - start:6.1f} s] group {i + 1}/{len(cells)} ({n} cells) "
            f"{group[1]} on {group[0]}: {what}",
            flush=True,
        )

    by_suite: dict[str, dict[str, Any]] = {}
    for name, suite in suites.items():
        found = estimate(suite, device, args.precision, batches=args.scaled, memo=memo, deadline=0)
        done = [e for e in found if e.total_s is not None]
        by_suite[name] = {
            "cells": sum(e.cells for e in found),
            "cells_measured": sum(e.cells for e in done),
            "device_hours": sum(e.total_s for e in done) / 3600,
            "estimates": [as_dict(e) for e in found],
        }
        by_suite[name]["device_hours_extrapolated"] = extrapolated(by_suite[name])
    by_paper = {
        p: {
            "suites": v,
            "cells": sum(by_suite[s]["cells"] for s in v),
            "cells_measured": sum(by_suite[s]["cells_measured"] for s in v),
            "device_hours": sum(by_suite[s]["device_hours"] for s in v),
        }
        for p, v in papers.items()
    }
    for p, v in by_paper.items():
        parts = [by_suite[s]["device_hours_extrapolated"] for s in v["suites"]]
        by_paper[p]["device_hours_extrapolated"] = None if None in parts else sum(parts)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"\ndevice-hours on {name} (precision {args.precision}, --scaled {args.scaled})")
    print("hours: of the measured cells; extrapolated: the others at their suite's mean per cell")
    head = f"{'cells':>7}{'measured':>10}{'hours':>9}{'extrapolated':>14}"
    row = lambda v: (  # noqa: E731
        f"{v['cells']:>7}{v['cells_measured']:>10}{v['device_hours']:>9.2f}"
        f"{_h(v['device_hours_extrapolated']):>14}"
    )
    print(f"{'suite':<22}{head}")
    for s, v in by_suite.items():
        print(f"{s:<22}{row(v)}")
    print(f"\n{'paper':<22}{head}  suites")
    for p, v in by_paper.items():
        print(f"{p:<22}{row(v)}  " + " ".join(v["suites"]))
    total = sum(v["device_hours"] for v in by_suite.values())
    parts = [v["device_hours_extrapolated"] for v in by_suite.values()]
    measured = sum(v["cells_measured"] for v in by_suite.values())
    print(
        f"\nall papers' suites, each once: {total:.2f} device-hours measured, "
        f"{_h(None if None in parts else sum(parts))} extrapolated "
        f"({measured} of {sum(v['cells'] for v in by_suite.values())} cells measured; "
        f"{time.monotonic() - start:.0f} s of measuring)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": name,
                    "scaled": args.scaled,
                    "precision": args.precision,
                    "suites": by_suite,
                    "papers": by_paper,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
