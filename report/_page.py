"""One self-contained HTML page: its charts as PNG files beside it and embedded.

Each chart is written to ``<stem>_png/<name>.png`` beside ``<stem>.html`` and
embedded in the page as a ``data:`` URI, so the page alone can be mailed and
opens from the file system: no script, no font, no stylesheet from anywhere.
"""

from __future__ import annotations

import base64
import html
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ringq import __version__

from ._charts import BarChart, TimeChart, draw

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; max-width: 1100px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
h3 { font-size: 1em; margin-top: 1.2em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
figure { margin: 0.6em 0; } img { max-width: 100%; }
.note { color: #555; } .empty { color: #a00; font-weight: bold; }
.pass { color: #070; font-weight: bold; } .fail { color: #a00; font-weight: bold; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
"""
_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass
class Figure:
    name: str  # file name without .png
    png: bytes
    caption: str


@dataclass
class Page:
    """The page being built, in order: headings, paragraphs, tables, charts."""

    title: str
    parts: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    def heading(self, text: str, level: int = 2) -> None:
        self.parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def paragraph(self, text: str, cls: str = "") -> None:
        attr = f' class="{cls}"' if cls else ""
        self.parts.append(f"<p{attr}>{html.escape(text)}</p>")

    def link(self, text: str, href: str) -> None:
        self.parts.append(f'<p><a href="{html.escape(href)}">{html.escape(text)}</a></p>')

    def pre(self, text: str) -> None:
        self.parts.append(f"<pre>{html.escape(text)}</pre>")

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]],
              left: int = 1) -> None:
        """A table; the first ``left`` columns are aligned left (names), the rest right."""
        def cell(tag: str, i: int, v: object) -> str:
            cls = ' class="l"' if i < left else ""
            return f"<{tag}{cls}>{html.escape(_fmt(v))}</{tag}>"

        head = "".join(cell("th", i, h) for i, h in enumerate(headers))
        body = "".join(
            "<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows
        )
        self.parts.append(f"<table><tr>{head}</tr>{body}</table>")

    def chart(self, name: str, chart: TimeChart | BarChart, caption: str = "") -> None:
        """Draw ``chart`` now and place it here."""
        name = _unique(_NAME_RE.sub("_", name), {f.name for f in self.figures})
        fig = Figure(name, draw(chart), caption)
        self.figures.append(fig)
        self.parts.append(f"\0{len(self.figures) - 1}\0")  # filled in by write()

    def write(self, out_dir: Path, stem: str) -> Path:
        """Write ``<stem>.html`` and ``<stem>_png/*.png`` into ``out_dir``; the page's path.
        The page is written last, through a temporary name: a reader never sees half a page."""
        out_dir.mkdir(parents=True, exist_ok=True)
        png_dir = out_dir / f"{stem}_png"
        png_dir.mkdir(exist_ok=True)
        for old in png_dir.glob("*.png"):  # a page written again: no stale charts beside it
            if old.stem not in {f.name for f in self.figures}:
                old.unlink(missing_ok=True)
        for fig in self.figures:
            (png_dir / f"{fig.name}.png").write_bytes(fig.png)
        body = []
        for part in self.parts:
            if part.startswith("\0"):
                fig = self.figures[int(part.strip("\0"))]
                data = base64.b64encode(fig.png).decode("ascii")
                src = f"{png_dir.name}/{fig.name}.png"
                cap = f"<figcaption class=\"note\">{html.escape(fig.caption)}</figcaption>"
                body.append(
                    f'<figure id="{fig.name}"><img alt="{html.escape(fig.name)}" '
                    f'data-file="{html.escape(src)}" src="data:image/png;base64,{data}">'
                    f"{cap if fig.caption else ''}</figure>"
                )
            else:
                body.append(part)
        made = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        text = (
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1>\n" + "\n".join(body)
            + f"\n<p class=\"note\">made by ringq {__version__} at {made}; the charts are also "
            f"in {html.escape(png_dir.name)}/</p></body></html>\n"
        )
        path = out_dir / f"{stem}.html"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        return path


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    n = 2
    while f"{name}-{n}" in taken:
        n += 1
    return f"{name}-{n}"


def _fmt(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else ("yes" if v else "no")
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return ""
        if v.is_integer() and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v)


def utc(t: float) -> str:
    """Unix seconds as ``YYYY-MM-DD HH:MM:SS`` UTC."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")
