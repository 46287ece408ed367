"""Screenshot of the HTML privacy report of a toy run, in a headless browser.

Run::

    python benchmarks/report_screenshot.py                      # toy run, then the screenshot
    python benchmarks/report_screenshot.py --run-dir runs/NAME  # an existing run's report

The toy run is one epoch of DP-SGD on 100 PneumoniaMNIST images (``--data`` overrides the
file), written to a temporary folder. The page is captured at ``--width`` pixels, full length,
to ``--out`` (default ``benchmarks/results/report_screenshot.png``).

A headless browser is needed: Chromium / Google Chrome, Firefox, or Playwright for Python with
its Chromium. Without one the script says what to install and exits with status 2, before any
training.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "report_screenshot.png"
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
    from dpkfc_med.training.loop import train

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


def screenshot(browser: tuple[str, str], page: Path, png: Path, width: int) -> None:
    """Capture ``page`` (an HTML file) at ``width`` pixels into ``png``."""
    png.parent.mkdir(parents=True, exist_ok=True)
    url = page.resolve().as_uri()
    kind, exe = browser
    if kind == "playwright":
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            chromium = pw.chromium.launch()
            tab = chromium.new_page(viewport={"width": width, "height": 900})
            tab.goto(url)
            tab.screenshot(path=str(png), full_page=True)
            chromium.close()
        return
    if kind == "chrome":
        cmd = [
            exe,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            f"--window-size={width},6000",
            f"--screenshot={png}",
            url,
        ]
    else:
        cmd = [exe, "--headless", "--screenshot", str(png), f"--window-size={width},6000", url]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, help="screenshot this run's report instead")
    parser.add_argument("--data", type=Path, default=DATA, help="data of the toy run")
    parser.add_argument("--out", type=Path, default=OUT, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1100, help="page width in pixels")
    args = parser.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print(f"error: {INSTALL.format(chromes=', '.join(CHROMES))}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or toy_run(Path(tmp), args.data)
        page = run_dir / "privacy_report.html"
        if not page.is_file():
            print(f"error: {page}: no HTML report; pass a run directory", file=sys.stderr)
            return 2
        screenshot(browser, page, args.out, args.width)
    print(f"screenshot ({browser[0]}): {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
