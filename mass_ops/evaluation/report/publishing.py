"""Publishing the report to the artifact store: `write_report` gathers, builds, draws and renders, then publishes
the figures first and the Markdown and HTML pages after them (each write atomic), so a page never references a
missing file."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from mass_ops.context import CycleContext
from mass_ops.evaluation.report.blocks import build_blocks
from mass_ops.evaluation.report.data import collect_report_data
from mass_ops.evaluation.report.figures import render_figures
from mass_ops.evaluation.report.rendering import render_html, render_markdown
from mass_ops.layout import report_prefix


def write_report(ctx: CycleContext, out_prefix: str | None = None) -> dict[str, Any]:
    """Render and publish the report: figures first, then the Markdown and HTML pages (each atomically).

    Returns ``{"markdown": uri, "html": uri, "figures": {name: uri}}``.
    """
    prefix = (out_prefix or report_prefix(ctx.cycle_name)).rstrip("/")
    data = collect_report_data(ctx)
    blocks = build_blocks(data)
    with tempfile.TemporaryDirectory(prefix="mass-report-") as scratch:
        pngs = {name: path.read_bytes() for name, path in render_figures(data, Path(scratch) / "figures").items()}
    # The page embeds the very bytes published as files, so its images and its links show the same figures.
    figures = {name: ctx.artifacts.put_bytes(f"{prefix}/figures/{name}.png", png).uri for name, png in pngs.items()}
    markdown = ctx.artifacts.put_bytes(f"{prefix}/report.md", render_markdown(blocks).encode("utf-8"))
    page = ctx.artifacts.put_bytes(f"{prefix}/report.html", render_html(blocks, pngs).encode("utf-8"))
    return {"markdown": markdown.uri, "html": page.uri, "figures": figures}
