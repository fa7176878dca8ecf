"""Write docs/report.png, the README's picture of the interactive report page (reports/html.py):
the page of `planner search --model llama-70b --cluster 8x8xA100 --report DIR` as headless
Chromium (Debian's `chromium` package) shows it at 1400 x 1000; a page of flat colours keeps the PNG
well under the MAX_BYTES the README's picture may take. tests/reports/test_html_page.py drives the
browser with `browse` too.

    python3 scripts/report_screenshot.py [--out docs/report.png]
"""
from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "report.png"
MAX_BYTES = 300_000
WINDOW = "--window-size=1400,1000"
# no GPU, no sandbox (CI runs as root in a container), and no name resolution: a page that tried
# to fetch anything from a network would fail to, not quietly succeed
FLAGS = ("--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
         "--host-resolver-rules=MAP * ~NOTFOUND")


def browse(chromium: str, page: Path, profile: Path, *flags: str, fragment: str = "",
           timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Chromium on the file `page` (+ `fragment`), with its own profile directory so that runs at
    once do not share one; stdout holds what --dump-dom writes."""
    url = page.resolve().as_uri() + fragment
    return subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *flags, url],
                          capture_output=True, text=True, timeout=timeout_s)


def screenshot(chromium: str, page: Path, work: Path) -> bytes:
    """The page's top, as an optimised PNG (its colours kept: the legend's must match the bars')."""
    from PIL import Image
    shot = work / "shot.png"
    done = browse(chromium, page, work / "profile", f"--screenshot={shot}", WINDOW)
    if not shot.exists():
        raise SystemExit(f"chromium wrote no screenshot (exit {done.returncode}): {done.stderr[-2000:]}")
    buffer = io.BytesIO()
    Image.open(shot).convert("RGB").save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the picture (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("needs Debian's chromium: apt-get update && apt-get install -y chromium")
    sys.path.insert(0, str(ROOT))
    from planner.cli import main as planner
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report"
        if planner(["search", "--model", "llama-70b", "--cluster", "8x8xA100", "--report", str(report)]) != 0:
            raise SystemExit("planner search failed")
        png = screenshot(chromium, report / "index.html", Path(tmp))
    if len(png) > MAX_BYTES:
        raise SystemExit(f"the screenshot is {len(png):,} bytes, over the {MAX_BYTES:,} the README's picture may take")
    args.out.write_bytes(png)
    print(f"wrote {args.out} ({len(png):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
