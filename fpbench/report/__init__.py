"""Reports from the results database: summary tables (`tables`) and figures (`plots`).

Import `fpbench.report.plots` explicitly; it is kept out of this namespace so that table-only
callers do not pay for importing matplotlib.
"""

from fpbench.report.tables import FORMATS, render, summary_stats, summary_table

__all__ = ["FORMATS", "render", "summary_stats", "summary_table"]
