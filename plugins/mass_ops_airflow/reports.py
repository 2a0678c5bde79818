"""Where the Airflow API server serves cycle reports, shared by the plugin's web app and the task link.

A report lives in the artifact store under `cycles/<cycle>/report/` (`report.html`, `report.md`, `figures/*.png`).
The plugin serves it at `<api base_url>/mass-ops/reports/<cycle>/`; the trailing slash makes the page's relative
figure links (`figures/<name>.png`) resolve to the figure route of the same cycle.

Light on purpose: workers import it to compute the link; the config's name rule is imported only when a name is
checked.
"""

from __future__ import annotations

import re
from urllib.parse import quote, urljoin

URL_PREFIX = "/mass-ops"
FIGURE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


class ReportNameError(ValueError):
    """A cycle or figure name that is not one safe path segment."""


def check_cycle(cycle: str) -> str:
    """`cycle` if it follows the config's name rule (so it is one path segment, never '..'); else ReportNameError."""
    from mass_ops.config import CYCLE_NAME

    if not CYCLE_NAME.fullmatch(cycle):
        raise ReportNameError(f"cycle {cycle!r}: a cycle name is 1-63 letters, digits, '.', '_' or '-'")
    return cycle


def check_figure(name: str) -> str:
    """`name` if it can be a figure's file stem (letters, digits, '_', '-'); else ReportNameError."""
    if not FIGURE_NAME.fullmatch(name):
        raise ReportNameError(f"figure {name!r}: a figure name is letters, digits, '_' or '-'")
    return name


def report_path(cycle: str) -> str:
    """Path of a cycle's report page under the API server's root, e.g. `/mass-ops/reports/demo-L0/`."""
    return f"{URL_PREFIX}/reports/{quote(check_cycle(cycle), safe='')}/"


def report_url(cycle: str, base_url: str | None = None) -> str:
    """The report page's URL under Airflow's `[api] base_url` (a path alone when that is `/`, the default)."""
    if base_url is None:
        from airflow.sdk import conf

        base_url = conf.get("api", "base_url", fallback="/") or "/"
    return urljoin(base_url.rstrip("/") + "/", report_path(cycle).lstrip("/"))
