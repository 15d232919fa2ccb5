"""Results database: SQLAlchemy models behind the small `Store` facade.

Callers import from here only: the store, its run records, and the vocabulary of cell claims
(an owner id, a claim's liveness, its timeout, and the error of a claim taken over).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fpbench.store.claims import CLAIM_TIMEOUT_S, ClaimLost, claim_is_live, new_owner
    from fpbench.store.repo import RunRecord, Store

_FROM = {
    "RunRecord": "repo",
    "Store": "repo",
    "CLAIM_TIMEOUT_S": "claims",
    "ClaimLost": "claims",
    "claim_is_live": "claims",
    "new_owner": "claims",
}
__all__ = [
    "CLAIM_TIMEOUT_S",
    "ClaimLost",
    "RunRecord",
    "Store",
    "claim_is_live",
    "new_owner",
]


def __getattr__(name: str) -> Any:
    # imported on first use, so `fpbench --help` (which imports fpbench.cli.db) stays fast
    if name in _FROM:  # the keys of _FROM are __all__
        import importlib

        return getattr(importlib.import_module(f"fpbench.store.{_FROM[name]}"), name)
    raise AttributeError(f"module 'fpbench.store' has no attribute {name!r}")
