"""Checkable sources of protocol rules and metric readings.

A source is a short text holding at least one anchor:

* a quote, `"..."`: a passage of the paper, verbatim (write the source as a TOML literal string,
  '...', so its double quotes need no escaping);
* a reference, `file:line` or `file:first-last`: lines of a spec of reference code or of a paper
  text (the files under shared/specs and shared/papers, e.g. `sgpt-reference-code.md:301`); a
  quote right after a reference (`sgpt-reference-code.md:301 "--comm_round 60"`) is checked
  against those lines instead of the paper;
* a code reference, `Name/path:line@commit` (or `:first-last@commit`): lines of a file of the
  official code checkout `Name` (../peer/Name beside the repository, e.g.
  `flip/scripts/run_batch.sh:22@ec3a848`) at that commit; a quote right after it is checked
  against those lines. Without the checkout the reference is not checked.

A rule whose paper value is "unstated" may instead say where the paper is silent, starting
`silent:`. `form_problems` checks the form without the texts; `text_problems` checks each quote
against its text (whitespace and hyphenated line breaks of the extracted PDFs normalised,
verbatim otherwise) and each reference against its file.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SILENT = "silent:"
_QUOTE = re.compile(r'"([^"]+)"')
_REF = re.compile(r"(?<![\w/.-])([A-Za-z0-9_-][A-Za-z0-9_.-]*\.(?:md|txt)):(\d+)(?:-(\d+))?")
_CODE = re.compile(
    r"(?<![\w/.-])([A-Za-z0-9][A-Za-z0-9_-]*)/([A-Za-z0-9_./+-]+):(\d+)(?:-(\d+))?@([0-9a-f]{7,40})"
)
_BETWEEN_REF_AND_QUOTE = re.compile(r"^[\s:,]*$")
TEXT_DIRS = ("specs", "papers")


@dataclass(frozen=True)
class Anchor:
    """A quote (with the reference it follows, if any) or a reference."""

    kind: str  # "quote", "ref" or "code"
    text: str = ""
    file: str = ""  # for code: Name/path
    first: int = 0
    last: int = 0
    ref: Anchor | None = None  # for a quote right after a reference
    commit: str = ""  # for code


def anchors(source: str) -> list[Anchor]:
    """The quotes and references of `source`, in order."""
    found: list[tuple[int, int, Anchor]] = []
    refs = [(m.start(), m.end(), _ref(m)) for m in _REF.finditer(source)]
    refs += [(m.start(), m.end(), _code(m)) for m in _CODE.finditer(source)]
    refs.sort(key=lambda r: r[0])
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


def _code(m: re.Match) -> Anchor:
    first = int(m.group(3))
    return Anchor(
        "code", file=f"{m.group(1)}/{m.group(2)}", first=first, last=int(m.group(4) or first),
        commit=m.group(5),
    )  # fmt: skip


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


def text_problems(
    source: str, paper_text: str | None, shared: Path, peer: Path | None = None
) -> list[str]:
    """Every quote of `source` not in its text and every reference to a missing file or line.

    `peer` is the folder of the official code checkouts (code references; None or a missing
    checkout: not checked); `paper_text` None: there is no paper, a quote needs a reference.
    """
    problems = []
    for a in anchors(source):
        if a.kind == "ref":
            problems += _ref_problems(a, shared)
            continue
        if a.kind == "code":
            problems += _code_problems(a, peer)
            continue
        where = "the paper"
        text = paper_text
        if a.ref is not None and a.ref.kind == "code":
            found = code_lines(a.ref, peer)
            if not isinstance(found, list):
                continue  # reported with the reference, or no checkout
            text = "\n".join(found[a.ref.first - 1 : a.ref.last])
            where = f"{a.ref.file}:{a.ref.first}-{a.ref.last}@{a.ref.commit}"
        elif a.ref is not None:
            path = find_text(a.ref.file, shared)
            if path is None or _ref_problems(a.ref, shared):
                continue  # reported with the reference
            lines = path.read_text().splitlines()
            text = "\n".join(lines[a.ref.first - 1 : a.ref.last])
            where = f"{a.ref.file}:{a.ref.first}" + (
                f"-{a.ref.last}" if a.ref.last != a.ref.first else ""
            )
        if text is None:
            problems.append(f"quote {a.text!r} follows no reference (there is no paper text)")
        elif not occurs(a.text, text):
            problems.append(f"quote {a.text!r} does not occur in {where}")
    return problems


def code_lines(a: Anchor, peer: Path | None) -> list[str] | str | None:
    """The lines of code reference `a` at its commit: a list, a problem (str), or None when
    the checkout is not here."""
    name, _, rel = a.file.partition("/")
    root = None if peer is None else peer / name
    if root is None or not root.is_dir():
        return None
    if (root / ".git").exists():
        lines = _git_show(str(root), a.commit, rel)
        if lines is None:
            return f"code reference {a.file}@{a.commit}: not in the checkout {root} at that commit"
        return list(lines)
    if not (root / rel).is_file():
        return f"code reference {a.file}: no such file in {root}"
    return (root / rel).read_text(errors="replace").splitlines()


@lru_cache(maxsize=256)
def _git_show(root: str, commit: str, rel: str) -> tuple[str, ...] | None:
    done = subprocess.run(
        ["git", "-C", root, "show", f"{commit}:{rel}"], capture_output=True, text=True, check=False
    )
    return None if done.returncode else tuple(done.stdout.splitlines())


def _code_problems(a: Anchor, peer: Path | None) -> list[str]:
    found = code_lines(a, peer)
    if isinstance(found, str):
        return [found]
    if found is not None and not 1 <= a.first <= a.last <= len(found):
        return [f"code reference {a.file}:{a.first}-{a.last}: the file has {len(found)} lines"]
    return []


def _ref_problems(a: Anchor, shared: Path) -> list[str]:
    path = find_text(a.file, shared)
    if path is None:
        return [f"reference {a.file}:{a.first}: no such file under {shared}/{{specs,papers}}"]
    count = len(path.read_text().splitlines())
    if not 1 <= a.first <= a.last <= count:
        return [f"reference {a.file}:{a.first}-{a.last}: the file has {count} lines"]
    return []
