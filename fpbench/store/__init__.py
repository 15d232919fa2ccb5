"""Results database: SQLAlchemy models behind the small `Store` facade."""

from fpbench.store.repo import RunRecord, Store

__all__ = ["RunRecord", "Store"]
