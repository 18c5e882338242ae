"""The run report in a real browser (Debian's chromium, headless), for the report tests
(test_report_browser, test_async_loop): whether plotly drew every panel in the DOM, what
the page logged, and a screenshot."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: scripts/setup.sh installs Debian's "
    "'chromium' package (apt-get install chromium); without it the browser check cannot run")
BROWSER_TIMEOUT_S = 180


def chromium(*args: str) -> subprocess.CompletedProcess:
    """Headless chromium; --no-sandbox because tests may run as root. The virtual-time
    budget lets the page's scripts (plotly drawing every figure) finish before the dump."""
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--disable-dev-shm-usage", "--enable-logging=stderr", "--v=0",
                           "--virtual-time-budget=20000", *args],
                          capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)


def rendered_figures(page: Path) -> tuple[dict[str, bool], str]:
    """For each report panel in the page, whether plotly drew it (an svg.main-svg inside
    its container) in the browser's DOM; and the browser's log."""
    done = chromium("--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    marks = list(re.finditer(r'data-report-figure="([a-z_]+)"', dom))
    out = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(dom)
        out[mark.group(1)] = 'class="main-svg"' in dom[mark.end():end]
    return out, done.stderr


def screenshot(page: Path, png: Path, height: int = 6000) -> Path:
    done = chromium(f"--screenshot={png}", f"--window-size=1400,{height}", page.as_uri())
    assert done.returncode == 0 and png.stat().st_size > 10_000, done.stderr[-2000:]
    return png


def check_in_browser(page: Path, expected: set[str], png: Path) -> None:
    figures, log = rendered_figures(page)
    assert set(figures) == expected
    assert all(figures.values()), [k for k, ok in figures.items() if not ok]
    # plotly reports bad figure input as console warnings; scripts that fail, as errors
    complaints = [line for line in log.splitlines() if "CONSOLE" in line]
    assert not complaints, complaints[:5]
    screenshot(page, png)
