"""Rendering blocks to text: `render_markdown` (figures referenced as files under `figure_dir`) and `render_html`, a
page that stands alone (opened from S3, mailed as an attachment): inline CSS, no scripts, every figure embedded as
a ``data:image/png;base64`` image wrapped in a link to its published PNG."""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence

from mass_ops.evaluation.report.model import FIGURES, Block


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block], figure_dir: str = "figures") -> str:
    """The blocks as Markdown; each figure an image that references its PNG file `<figure_dir>/<name>.png`."""
    titles = dict(FIGURES)
    lines: list[str] = []
    for block in blocks:
        if block.kind == "title":
            lines += [f"# {block.text}", ""]
        elif block.kind in ("h2", "h3"):
            lines += [f"{'#' * (2 if block.kind == 'h2' else 3)} {block.text}", ""]
        elif block.kind == "p":
            lines += [block.text, ""]
        elif block.kind == "note":
            lines += [f"> **Note.** {block.text}", ""]
        elif block.kind == "table":
            lines.append("| " + " | ".join(_md_cell(h) for h in block.headers) + " |")
            lines.append("|" + "|".join("---" for _ in block.headers) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
            lines.append("")
        elif block.kind == "figure":
            lines += [f"![{titles[block.text]}]({figure_dir}/{block.text}.png)", ""]
        elif block.kind == "link":
            lines += [f"[{_md_cell(block.text)}](<{block.href}>)", ""]
    return "\n".join(lines).rstrip() + "\n"


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222; margin: 0;
       background: #fafafa; }
main { max-width: 1080px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 1.7em; border-bottom: 2px solid #3d6f94; padding-bottom: 6px; }
h2 { font-size: 1.3em; margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.88em; }
th, td { border: 1px solid #d5d5d5; padding: 4px 9px; text-align: left; }
th { background: #eef3f7; }
tr:nth-child(even) td { background: #fafcfd; }
figure { margin: 1em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
.note { background: #fff6e0; border-left: 4px solid #e0a800; padding: 8px 12px; margin: 0.6em 0; }
.meta { color: #555; }
"""


def render_html(blocks: Sequence[Block], figures: Mapping[str, bytes], figure_dir: str = "figures") -> str:
    """A self-contained page: inline CSS, no scripts, each figure's PNG (`figures[name]`) embedded as a data URI and
    wrapped in a link to the published file `<figure_dir>/<name>.png`; a figure missing from `figures` is a KeyError."""
    titles = dict(FIGURES)
    body: list[str] = []
    title = "MASS cycle report"
    for block in blocks:
        text = html.escape(block.text)
        if block.kind == "title":
            title = block.text
            body.append(f"<h1>{text}</h1>")
        elif block.kind in ("h2", "h3"):
            body.append(f"<{block.kind}>{text}</{block.kind}>")
        elif block.kind == "p":
            body.append(f"<p>{text}</p>")
        elif block.kind == "note":
            body.append(f'<div class="note"><strong>Note.</strong> {text}</div>')
        elif block.kind == "link":
            body.append(f'<p><a href="{html.escape(block.href)}">{text}</a></p>')
        elif block.kind == "table":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.headers)
            rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in block.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif block.kind == "figure":
            caption = html.escape(titles[block.text])
            target = html.escape(f"{figure_dir}/{block.text}.png")
            embedded = "data:image/png;base64," + base64.b64encode(figures[block.text]).decode("ascii")
            body.append(
                f'<figure><a href="{target}"><img src="{embedded}" alt="{caption}"></a>'
                f"<figcaption>{caption}</figcaption></figure>"
            )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n"
        + "\n".join(body)
        + "\n</main>\n</body>\n</html>\n"
    )
