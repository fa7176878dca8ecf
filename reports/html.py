"""The interactive report page, index.html: one self-contained file. Its style and script are
inline (reports/assets, package data), its data one inline JSON blob (reports.page_data), and it
fetches nothing: no network, no fonts; the report's PNG figures beside it are linked as files.
The script draws the pipeline timeline (zoom, pan, hover), memory per stage (hover) and a sweep's
curve as inline SVG, and makes every table sortable; with `#selftest` in the address it exercises
itself and writes the outcome into the page (#report-status), where a headless browser reads it."""
from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any

SCRIPT_PARTS = ("page_common.js", "page_charts.js", "page_main.js")   # one function scope, in this order

# Runs first, in <head>: every error and console.error of the page, kept for #report-status.
ERROR_CATCHER = ("window.__reportErrors=[];window.addEventListener('error',function(e){"
                 "window.__reportErrors.push('error: '+e.message+' at '+(e.filename||'')+':'+(e.lineno||0));});"
                 "window.addEventListener('unhandledrejection',function(e){"
                 "window.__reportErrors.push('unhandled rejection: '+e.reason);});"
                 "(function(){var log=console.error;console.error=function(){"
                 "window.__reportErrors.push('console.error: '+Array.prototype.join.call(arguments,' '));"
                 "return log.apply(console,arguments);};})();")


def _asset(name: str) -> str:
    return resources.files("reports").joinpath("assets", name).read_text(encoding="utf-8")


def script() -> str:
    """The page's script: its parts inside one function, so they share names but leak none."""
    return "(function () {\n" + "".join(_asset(n) for n in SCRIPT_PARTS) + "})();\n"


def data_blob(data: dict[str, Any]) -> str:
    """JSON that cannot end its <script> element early ("</" written as "<\\/", which JSON reads
    back as "</"); NaN or infinity is a bug here, not a value to pass on."""
    return json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")


def page(data: dict[str, Any], document_html: str = "") -> str:
    """The page: the interactive panels the data has, then the report's own blocks."""
    e = html.escape
    title = data["title"]
    return "\n".join([
        "<!doctype html>", "<html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{e(title)}</title>", f"<script>{ERROR_CATCHER}</script>",
        f"<style>\n{_asset('report.css')}</style></head><body>",
        "<div id='report-status' data-status='pending' data-errors='0' data-selftest='not run'>page loading</div>",
        f"<h1>{e(title)}</h1>", "<pre id='report-errors'></pre>",
        *_lead(data),
        *_panels(data),
        "<div id='tooltip' hidden></div>",
        document_html,
        f"<script type='application/json' id='report-data'>{data_blob(data)}</script>",
        f"<script>\n{script()}</script>", "</body></html>"])


def _lead(data: dict[str, Any]) -> list[str]:
    s = data["summary"]
    if s is None:
        return []
    gib = 2.0 ** 30
    return [f"<p class='lead'>Plan <b>{html.escape(s['plan'])}</b>: {s['step_time_s']:.3f} s per step, "
            f"{s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}%, bubble {100 * s['bubble_fraction']:.1f}% "
            f"of the step (rank {s['critical_rank']}), peak {s['peak_memory_bytes'] / gib:.1f} of "
            f"{s['capacity_bytes'] / gib:.1f} GiB per device.</p>"]


def _panels(data: dict[str, Any]) -> list[str]:
    out = []
    if data["ranking"]:
        out += ["<h2>Ranking</h2>", "<p class='note'>Click a header to sort by it. "
                + html.escape(data["bubble_definition"] or "") + ".</p>",
                "<table id='ranking' class='sortable'></table>"]
    if data["timelines"]:
        out += ["<h2>Pipeline timeline</h2>",
                "<p class='note'>The simulated schedule, one row per pipeline rank (its bubble, a share of the "
                "step, beside it): wheel or buttons to zoom, drag to pan, hover a bar for its operation, rank, "
                "micro-batch and times. The step and bubble of each schedule are the whole step's; its label "
                "names the micro-batches drawn when they are fewer than the step's.</p>",
                "<div class='controls'><select id='tl-variant' aria-label='schedule'></select>"
                "<button id='tl-in' type='button'>zoom in</button><button id='tl-out' type='button'>zoom out</button>"
                "<button id='tl-reset' type='button'>whole step</button><span id='tl-range'></span></div>",
                "<svg id='timeline' class='chart' role='img' aria-label='pipeline timeline'></svg>",
                "<div class='legend' id='tl-legend'></div>"]
    if data["memory"]:
        out += ["<h2>Memory per stage</h2>",
                "<p class='note'>Peak memory per device of each pipeline stage by part, against its capacity "
                "(dashed); hover a part for its size.</p>",
                "<svg id='memory' class='chart' role='img' aria-label='memory per stage'></svg>",
                "<div class='legend' id='mem-legend'></div>"]
    if data["sweep"]:
        out += ["<h2>Scaling</h2>",
                "<p class='note'>The best plan at each size; hover a point for its plan and run. Large points: "
                "each device's knee; black: the cheapest size.</p>",
                "<div class='controls'>plot <select id='sweep-metric' aria-label='metric'></select></div>",
                "<svg id='sweep' class='chart' role='img' aria-label='scaling curve'></svg>"]
    return out
