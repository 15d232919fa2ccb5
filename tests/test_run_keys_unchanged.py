"""The run keys of every shipped suite stay what they were: refactors of methods, datasets and
their registration (variants as table rows) must not change what a stored run is keyed by.

`tests/data/shipped_run_keys.json` holds, per suite, its number of cells and the sha256 of its
sorted run keys. A change that is meant to change them (a new cell, a new config field with a
default that is not dropped from the identity) rewrites it with
`python -m tests.test_run_keys_unchanged` and says so in its commit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fpbench.suites import list_suites, load_suite

STORED = Path(__file__).parent / "data" / "shipped_run_keys.json"


def shipped_run_keys() -> dict[str, dict[str, object]]:
    out = {}
    for name in list_suites():
        keys = sorted(cell.run_key for cell in load_suite(name).cells)
        out[name] = {
            "cells": len(keys),
            "sha256": hashlib.sha256(",".join(keys).encode()).hexdigest(),
        }
    return out


def test_every_shipped_suite_keeps_its_run_keys():
    stored = json.loads(STORED.read_text())
    now = shipped_run_keys()
    changed = {name: (stored.get(name), now.get(name)) for name in stored.keys() | now.keys()
               if stored.get(name) != now.get(name)}  # fmt: skip
    assert not changed, changed


if __name__ == "__main__":
    STORED.write_text(json.dumps(shipped_run_keys(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {STORED}")
