"""A report as a list of blocks, rendered to Markdown and to HTML from the same content."""
from __future__ import annotations

import html
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass
class Document:
    title: str
    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def heading(self, text: str) -> None:
        self.blocks.append(("h2", text))

    def text(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.blocks.append(("table", ([str(h) for h in headers], [[str(c) for c in r] for r in rows])))

    def image(self, stem: str, caption: str) -> None:
        self.blocks.append(("img", (stem, caption)))

    def figures(self, draw: Callable[[], list[tuple[str, str]]]) -> None:
        """The images `draw` saves, by (file stem, caption), in this place: drawn by draw_figures."""
        self.blocks.append(("draw", draw))

    def draw_figures(self, map_draws: Callable[[Callable, list], list] | None = None) -> None:
        """Every figure left to draw, drawn by `map_draws(fn, items)` (a map, which may run items
        in another process: the figures are independent files), then placed as images in order."""
        draws = [value for kind, value in self.blocks if kind == "draw"]
        drawn = iter((map_draws or _serial)(operator.call, draws))
        blocks: list[tuple[str, Any]] = []
        for kind, value in self.blocks:
            blocks += [("img", image) for image in next(drawn)] if kind == "draw" else [(kind, value)]
        self.blocks = blocks

    def markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for kind, value in self.blocks:
            if kind == "h2":
                out += [f"## {value}", ""]
            elif kind == "p":
                out += [value, ""]
            elif kind == "table":
                headers, rows = value
                out.append("| " + " | ".join(headers) + " |")
                out.append("|" + "|".join("---" for _ in headers) + "|")
                out += ["| " + " | ".join(r) + " |" for r in rows]
                out.append("")
            else:
                stem, caption = value
                out += [f"![{caption}]({stem}.png)", "", f"*{caption}* ([SVG]({stem}.svg))", ""]
        return "\n".join(out)

    def html(self) -> str:
        """The blocks as HTML elements (reports.html puts them in its page)."""
        e = html.escape
        out = []
        for kind, value in self.blocks:
            if kind == "h2":
                out.append(f"<h2>{e(value)}</h2>")
            elif kind == "p":
                out.append(f"<p>{e(value)}</p>")
            elif kind == "table":   # sortable on the page: a click on a header sorts by it
                headers, rows = value
                out.append("<table class='sortable'><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers)
                           + "</tr></thead><tbody>")
                out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
                out.append("</tbody></table>")
            else:
                stem, caption = value
                out.append(f"<figure><a href='{stem}.svg'><img src='{stem}.png' alt='{e(caption)}'></a>"
                           f"<figcaption>{e(caption)}</figcaption></figure>")
        return "\n".join(out)


def _serial(fn: Callable, items: list) -> list:
    return [fn(x) for x in items]

