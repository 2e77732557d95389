"""ringq.report: pages of charts over the monitor's history and of regression runs.

Each page is one self-contained HTML file, its charts (PNG, drawn by
matplotlib's Agg backend: no display) both written beside it and embedded,
so that it opens from the file system and can be mailed. Everything is read
from files: the monitor's data directory (T4 files, ``monitor.log``, read
through :mod:`ringq.monitor`'s readers) and a regression run's directory.

    from ringq.report import period_page, compare_page

    page = period_page(Path(".ringq/monitor"), t0, t1, Path("out"))   # out/report.html
    page = compare_page([Path(".ringq/regress/A"), Path(".ringq/regress/B")], Path("out"))

The regression runner writes its pages through :class:`RunPages` (a
:class:`CycleRecorder` follows each cycle). matplotlib is imported only when a
chart is drawn: importing this package does not import it.
"""

from ._errors import NoData
from ._period import period_page
from ._runs import CycleRecorder, RunPages, compare_page, load_run_dir

__all__ = [
    "CycleRecorder",
    "NoData",
    "RunPages",
    "compare_page",
    "load_run_dir",
    "period_page",
]
