"""Run every registered method (or those named) on the tiny federation into one results database.

The offline suites (`scripts/offline_suites.sh`) reach only the methods they name; this runs each
registered method's tiny suite (`fpbench.tiny.tiny_suite`: the conformance kit's federation, its
offline args, the test-sized backbone of its family) with the `fpbench` on PATH, so that a change
to the method interface can be checked on every method's stored values:

    python scripts/every_method_tiny.py /tmp/before --device cpu --threads 1   # at commit A
    python scripts/every_method_tiny.py /tmp/after --device cpu --threads 1    # at commit B
    fpbench db diff /tmp/before/results.db /tmp/after/results.db

Options after OUT_DIR go to every `fpbench run`. OUT_DIR must be new or empty; the suite files
are written to OUT_DIR/suites, the cache to OUT_DIR/cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def toml_value(value: Any) -> str:
    """`value` as an inline TOML value (scalars, lists and tables of them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for the names and args used here
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        usage = f"usage: {sys.argv[0]} OUT_DIR [fpbench run options...] [-- names...]"
        print(usage, file=sys.stderr)
        return 2
    out, rest = Path(argv[0]), argv[1:]
    names = rest[rest.index("--") + 1 :] if "--" in rest else []
    options = rest[: rest.index("--")] if "--" in rest else rest
    if out.exists() and any(out.iterdir()):
        print(f"{out} is not empty: give a new or empty folder", file=sys.stderr)
        return 2
    fpbench = shutil.which(os.environ.get("FPBENCH", "fpbench"))
    if fpbench is None:
        print("no fpbench on PATH", file=sys.stderr)
        return 2
    from fpbench.registry import METHODS
    from fpbench.tiny import tiny_suite

    (out / "suites").mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    env = {**os.environ, "FPBENCH_CACHE": str(out / "cache")}
    for name in names or METHODS.names():
        suite = out / "suites" / f"tiny-{name}.toml"
        lines = [f"name = {toml_value(f'tiny-{name}')}"]
        lines += [f"{k} = {toml_value(v)}" for k, v in tiny_suite(name).items()]
        suite.write_text("\n".join(lines) + "\n")
        print(f"== {name}", flush=True)
        cmd = [fpbench, "run", "--suite", str(suite), "--db", str(out / "results.db"),
               "--checkpoint-dir", str(out / "checkpoints"), "--job-dir", str(out / "jobs"),
               "--log-dir", str(out / "logs"), *options]  # fmt: skip
        if subprocess.run(cmd, cwd=out, env=env).returncode:
            print(f"{name}: fpbench run failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
