"""Screenshot of the HTML privacy report of a toy run, in a headless browser.

Run::

    python -m dpkfc_bench report-screenshot                      # toy run, then the screenshot
    python -m dpkfc_bench report-screenshot --run-dir runs/NAME  # an existing run's report
    python -m dpkfc_bench report-screenshot --run-dir runs/NAME --rerender --markdown

The toy run is one epoch of DP-SGD on 100 PneumoniaMNIST images (``--data`` overrides the
file), written to a temporary folder. The page is captured at ``--width`` pixels, full length
(up to ``--height``; blank space below the page is trimmed when Pillow is installed), to
``--out`` (default ``dpkfc_bench/results/report_screenshot.png``).

``--first-screen`` captures only what a data-protection officer sees first (the title, any
warning banners, the "In plain words" box and the contents list: ``--screen-height`` pixels,
1080 by default), as a small palette PNG. The committed first screens were made with::

    dpkfc-med train configs/pneumoniamnist_cnn_2d_eps1.yaml --out runs/main
    python -m dpkfc_bench report-screenshot --run-dir runs/main --first-screen \
        --out dpkfc_bench/results/report_first_screen_main.png
    dpkfc-med bundle train tests/bundle/zoo_bundle --epsilon 8 --out runs/zoo \
        --override dataset_dir=DATA/msd_hippocampus --override num_train=6 \
        --override 'train#trainer#max_epochs=1' --set training.progress=false
    python -m dpkfc_bench report-screenshot --run-dir runs/zoo --first-screen \
        --out dpkfc_bench/results/report_first_screen_bundle.png

(a copy of ``tests/bundle/zoo_bundle`` keeps the test bundle clean; ``DATA`` is the shared data
folder).

``--rerender`` renders the views from the run's ``privacy_report.json`` with the code as it is
now, into a temporary folder (the run directory is not touched): the way to look at a rendering
change on an existing run. ``--markdown`` also captures the Markdown views (the privacy report
and, when present, the custodian report), turned into HTML by markdown-it-py as a Markdown
viewer would, next to ``--out`` as ``<out>_md.png`` and ``<out>_custodian_md.png``.

A headless browser is needed: Chromium / Google Chrome, Firefox, or Playwright for Python with
its Chromium. Without one the script says what to install and exits with status 2, before any
training.
"""

from __future__ import annotations

import argparse
import html
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dpkfc_bench.harness import RESULTS, ROOT

OUT = RESULTS / "report_screenshot.png"
DATA = ROOT.parent / "shared" / "data" / "medmnist" / "pneumoniamnist.npz"
CHROMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
INSTALL = (
    "no headless browser found: looked for {chromes}, firefox and the Python package "
    "playwright. Install one of them, e.g. `apt-get install chromium` (Debian/Ubuntu), "
    "`apt-get install firefox-esr`, or `pip install playwright && playwright install chromium`, "
    "then run this script again"
)


def find_browser() -> tuple[str, str] | None:
    """``(kind, executable)`` of the first headless browser found, ``kind`` in chrome/firefox/
    playwright; ``None`` when there is none."""
    for name in CHROMES:
        path = shutil.which(name)
        if path:
            return "chrome", path
    path = shutil.which("firefox")
    if path:
        return "firefox", path
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None
    return "playwright", "playwright"


def toy_run(out_dir: Path, data: Path) -> Path:
    """Train the toy run and return its run directory (it holds privacy_report.html)."""
    from dpkfc_med.training.config import config_from_dict
    from dpkfc_med.training.run import train

    cfg = config_from_dict(
        {
            "name": "report_screenshot_toy",
            "method": "dp-sgd",
            "data": {"path": str(data), "max_train": 100, "max_eval": 64},
            "model": {"name": "small_cnn"},
            "privacy": {"target_epsilon": 3.0, "max_grad_norm": 1.0},
            "training": {"epochs": 1, "batch_size": 40, "lr": 0.05, "progress": False},
            "output": {"dir": str(out_dir / "run")},
        }
    )
    return train(cfg).run_dir


def rerendered(run_dir: Path, out_dir: Path) -> Path:
    """Render ``run_dir``'s views from its JSON with the current code into ``out_dir``."""
    from dpkfc_med.report.custodian import CUSTODIAN_FILES
    from dpkfc_med.report.writer import rerender

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(run_dir / "privacy_report.json", out_dir / "privacy_report.json")
    custodian = run_dir / CUSTODIAN_FILES["json"]
    if custodian.is_file():
        (out_dir / CUSTODIAN_FILES["json"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(custodian, out_dir / CUSTODIAN_FILES["json"])
    rerender(out_dir)
    return out_dir


_MD_CSS = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem;
       line-height: 1.5; color: #1f2328; }
table { border-collapse: collapse; } th, td { border: 1px solid #d1d9e0; padding: 0.3rem 0.6rem; }
blockquote { border-left: 4px solid #d1d9e0; margin: 0; padding: 0 1rem; color: #59636e; }
pre { background: #f6f8fa; padding: 0.8rem; overflow-x: auto; }
code { background: #f6f8fa; }
img { max-width: 100%; }
"""


def markdown_page(markdown: Path, page: Path) -> bool:
    """Write ``markdown`` as an HTML ``page`` (GitHub-like), or return False without the parser."""
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        return False
    body = MarkdownIt("commonmark").enable("table").render(markdown.read_text(encoding="utf-8"))
    page.write_text(
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><base href="{markdown.parent.as_uri()}/">'
        f"<title>{html.escape(markdown.name)}</title><style>{_MD_CSS}</style></head>"
        f"<body>{body}</body></html>",
        encoding="utf-8",
    )
    return True


def _trim(png: Path) -> None:
    """Cut the blank rows below the page (a headless Chrome window is taller than the page)."""
    try:
        from PIL import Image, ImageChops
    except ImportError:
        return
    with Image.open(png) as image:
        rgb = image.convert("RGB")
    # ignore the right edge, where a scrollbar may be drawn
    body = rgb.crop((0, 0, max(1, rgb.width - 30), rgb.height))
    box = ImageChops.difference(body, Image.new("RGB", body.size, (255, 255, 255))).getbbox()
    if box is not None and box[3] + 40 < rgb.height:
        rgb.crop((0, 0, rgb.width, box[3] + 40)).save(png)


def _small(png: Path) -> None:
    """Store a screenshot as a 128-colour palette PNG (text and boxes stay sharp, the file small)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    small.save(png, optimize=True)


def screenshot(
    browser: tuple[str, str],
    page: Path,
    png: Path,
    width: int,
    height: int = 16000,
    *,
    trim: bool = True,
) -> None:
    """Capture ``page`` (an HTML file) at ``width`` pixels into ``png``, at most ``height`` long.

    ``trim=False`` keeps the capture at ``height`` exactly (a first screen).
    """
    png.parent.mkdir(parents=True, exist_ok=True)
    url = page.resolve().as_uri()
    kind, exe = browser
    if kind == "playwright":
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            chromium = pw.chromium.launch()
            tab = chromium.new_page(viewport={"width": width, "height": 900 if trim else height})
            tab.goto(url)
            tab.screenshot(path=str(png), full_page=trim)
            chromium.close()
        return
    with tempfile.TemporaryDirectory() as profile:
        if kind == "chrome":
            # a fresh profile and no background traffic: the page is a local file
            cmd = [
                exe,
                "--headless",
                "--disable-gpu",
                "--no-sandbox",
                "--hide-scrollbars",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--screenshot={png}",
                url,
            ]
        else:
            cmd = [
                exe,
                "--headless",
                "--profile",
                profile,
                "--screenshot",
                str(png),
                f"--window-size={width},{height}",
                url,
            ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    if trim:
        _trim(png)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, help="screenshot this run's report instead")
    parser.add_argument("--data", type=Path, default=DATA, help="data of the toy run")
    parser.add_argument("--out", type=Path, default=OUT, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1100, help="page width in pixels")
    parser.add_argument("--height", type=int, default=16000, help="longest capture in pixels")
    parser.add_argument(
        "--first-screen",
        action="store_true",
        help="capture only the first screen (verdict box and contents), as a small PNG",
    )
    parser.add_argument(
        "--screen-height", type=int, default=1080, help="height of the first screen in pixels"
    )
    parser.add_argument(
        "--rerender", action="store_true", help="render the views from the JSON with this code"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="also capture the Markdown views (markdown-it-py)"
    )
    args = parser.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print(f"error: {INSTALL.format(chromes=', '.join(CHROMES))}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or toy_run(Path(tmp), args.data)
        if args.rerender:
            if not (run_dir / "privacy_report.json").is_file():
                print(f"error: {run_dir}: no privacy_report.json to render", file=sys.stderr)
                return 2
            run_dir = rerendered(run_dir, Path(tmp) / "rerendered")
        page = run_dir / "privacy_report.html"
        if not page.is_file():
            print(f"error: {page}: no HTML report; pass a run directory", file=sys.stderr)
            return 2
        if args.first_screen:
            screenshot(browser, page, args.out, args.width, args.screen_height, trim=False)
            _small(args.out)
        else:
            screenshot(browser, page, args.out, args.width, args.height)
        print(f"screenshot ({browser[0]}): {args.out}")
        if args.markdown:
            views = {
                "md": run_dir / "privacy_report.md",
                "custodian_md": run_dir / "private_not_for_release" / "custodian_report.md",
            }
            for suffix, markdown in views.items():
                if not markdown.is_file():
                    continue
                md_page = Path(tmp) / f"{suffix}.html"  # its <base> points at the run
                if not markdown_page(markdown, md_page):
                    print("Markdown views skipped: pip install markdown-it-py", file=sys.stderr)
                    break
                png = args.out.with_name(f"{args.out.stem}_{suffix}.png")
                screenshot(browser, md_page, png, args.width, args.height)
                print(f"screenshot ({browser[0]}): {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
