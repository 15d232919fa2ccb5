"""Checkable sources of protocol rules and metric readings.

A source is a short text holding at least one anchor:

* a quote, `"..."`: a passage of the paper, verbatim (write the source as a TOML literal string,
  '...', so its double quotes need no escaping);
* a reference, `file:line` or `file:first-last`: lines of a spec of reference code or of a paper
  text (the files under shared/specs and shared/papers, e.g. `sgpt-reference-code.md:301`); a
  quote right after a reference (`sgpt-reference-code.md:301 "--comm_round 60"`) is checked
  against those lines instead of the paper.

A rule whose paper value is "unstated" may instead say where the paper is silent, starting
`silent:`. `form_problems` checks the form without the texts; `text_problems` checks each quote
against its text (whitespace and hyphenated line breaks of the extracted PDFs normalised,
verbatim otherwise) and each reference against its file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SILENT = "silent:"
_QUOTE = re.compile(r'"([^"]+)"')
_REF = re.compile(r"(?<![\w/.-])([A-Za-z0-9_-][A-Za-z0-9_.-]*\.(?:md|txt)):(\d+)(?:-(\d+))?")
_BETWEEN_REF_AND_QUOTE = re.compile(r"^[\s:,]*$")
TEXT_DIRS = ("specs", "papers")


@dataclass(frozen=True)
class Anchor:
    """A quote (with the reference it follows, if any) or a reference."""

    kind: str  # "quote" or "ref"
    text: str = ""
    file: str = ""
    first: int = 0
    last: int = 0
    ref: Anchor | None = None  # for a quote right after a reference


def anchors(source: str) -> list[Anchor]:
    """The quotes and references of `source`, in order."""
    found: list[tuple[int, int, Anchor]] = []
    refs = [(m.start(), m.end(), _ref(m)) for m in _REF.finditer(source)]
    found += refs
    for m in _QUOTE.finditer(source):
        before = [r for r in refs if r[1] <= m.start()]
        ref = None
        if before and _BETWEEN_REF_AND_QUOTE.match(source[before[-1][1] : m.start()]):
            ref = before[-1][2]
        found.append((m.start(), m.end(), Anchor("quote", m.group(1), ref=ref)))
    return [a for _, _, a in sorted(found, key=lambda f: f[0])]


def _ref(m: re.Match) -> Anchor:
    first = int(m.group(2))
    return Anchor("ref", file=m.group(1), first=first, last=int(m.group(3) or first))


def form_problems(source: str, *, unstated: bool = False) -> list[str]:
    """Why `source` is not a checkable source (empty when it is)."""
    if anchors(source):
        return []
    if unstated and source.strip().startswith(SILENT) and len(source.strip()) > len(SILENT):
        return []
    allowed = ", or 'silent: where the paper is silent'" if unstated else ""
    return [f'source {source!r} has no quote ("...") or file:line reference{allowed}']


def normalise(text: str, join_hyphens: bool = False) -> str:
    """`text` with every whitespace run one space and a hyphen ending a line joined to the next
    word: kept ("few-\\nshot" -> "few-shot"), or with `join_hyphens` dropped
    ("proto-\\ntypes" -> "prototypes")."""
    text = re.sub(r"(\w)-[ \t]*\n\s*(\w)", r"\1\2" if join_hyphens else r"\1-\2", text)
    return re.sub(r"\s+", " ", text).strip()


def occurs(quote: str, text: str) -> bool:
    """Whether `quote` is a passage of `text`, up to whitespace and hyphenated line breaks."""
    q = normalise(quote)
    return q in _normalised(text, False) or q in _normalised(text, True)


@lru_cache(maxsize=32)
def _normalised(text: str, join_hyphens: bool) -> str:
    return normalise(text, join_hyphens)  # a paper's text, normalised once for all its quotes


def find_text(name: str, shared: Path) -> Path | None:
    """The file `name` under shared/specs or shared/papers, if there."""
    for sub in TEXT_DIRS:
        if (shared / sub / name).is_file():
            return shared / sub / name
    return None


def text_problems(source: str, paper_text: str, shared: Path) -> list[str]:
    """Every quote of `source` not in its text and every reference to a missing file or line."""
    problems = []
    for a in anchors(source):
        if a.kind == "ref":
            problems += _ref_problems(a, shared)
            continue
        where = "the paper"
        text = paper_text
        if a.ref is not None:
            path = find_text(a.ref.file, shared)
            if path is None or _ref_problems(a.ref, shared):
                continue  # reported with the reference
            lines = path.read_text().splitlines()
            text = "\n".join(lines[a.ref.first - 1 : a.ref.last])
            where = f"{a.ref.file}:{a.ref.first}" + (
                f"-{a.ref.last}" if a.ref.last != a.ref.first else ""
            )
        if not occurs(a.text, text):
            problems.append(f"quote {a.text!r} does not occur in {where}")
    return problems


def _ref_problems(a: Anchor, shared: Path) -> list[str]:
    path = find_text(a.file, shared)
    if path is None:
        return [f"reference {a.file}:{a.first}: no such file under {shared}/{{specs,papers}}"]
    count = len(path.read_text().splitlines())
    if not 1 <= a.first <= a.last <= count:
        return [f"reference {a.file}:{a.first}-{a.last}: the file has {count} lines"]
    return []
