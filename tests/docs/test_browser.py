"""Every page of the site in headless Chromium at 1400 and 420 px: nothing sticks
out of the page except inside a box that scrolls (code, tables, formulas,
figures), and the math font loads. One Chromium process loads all pages, each in
an iframe of the width under test, and reports what it measured."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

WIDTHS = (1400, 420)

MEASURE = r"""
function overflow(frame) {
  const doc = frame.contentDocument, win = frame.contentWindow;
  const W = doc.documentElement.clientWidth, bad = [];
  if (doc.documentElement.scrollWidth > W + 1)
    bad.push("page is " + doc.documentElement.scrollWidth + " px wide");
  for (const el of doc.body.querySelectorAll("*")) {
    const r = el.getBoundingClientRect();
    if ((r.width === 0 && r.height === 0) || (r.right <= W + 1 && r.left >= -1))
      continue;
    let p = el.parentElement, boxed = false;
    while (p && p !== doc.body) {
      const ox = win.getComputedStyle(p).overflowX;
      if (ox === "auto" || ox === "scroll") { boxed = true; break; }
      p = p.parentElement;
    }
    if (!boxed) bad.push(el.tagName.toLowerCase() + "." + el.className + " "
                         + Math.round(r.left) + ".." + Math.round(r.right));
  }
  const math = doc.querySelector("math");
  return {page: frame.dataset.page, width: +frame.dataset.width,
          bad: bad.slice(0, 5),
          font: !math || Array.from(doc.fonts).some(
            f => f.family.includes("Latin Modern Math") && f.status === "loaded")};
}
window.addEventListener("load", () => {
  const frames = Array.from(document.querySelectorAll("iframe"));
  Promise.all(frames.map(f => f.contentDocument.fonts.ready)).then(() => {
    const out = document.getElementById("out");
    out.textContent = JSON.stringify(frames.map(overflow));
  });
});
"""


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is needed: apt-get install -y chromium")


def chromium(url: str, profile: Path, *extra: str, timeout: int = 120):
    cmd = [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu",
        "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
        *extra, url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def note_pages(site: Path) -> list[str]:
    return sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                  if not p.relative_to(site).as_posix().startswith("source/"))


def measure(site: Path, pages: list[str], tmp: Path) -> list[dict]:
    frames = "\n".join(
        f'<iframe data-page="{p}" data-width="{w}" width="{w}" height="900" '
        f'src="{(site / p).resolve().as_uri()}"></iframe>'
        for w in WIDTHS for p in pages)
    harness = tmp / "harness.html"
    harness.write_text(f"<!DOCTYPE html><html><body>{frames}"
                       f'<pre id="out"></pre><script>{MEASURE}</script>'
                       "</body></html>", encoding="utf-8")
    proc = chromium(harness.as_uri(), tmp / "profile", "--dump-dom",
                    "--allow-file-access-from-files", "--virtual-time-budget=30000",
                    timeout=180)
    match = re.search(r'<pre id="out">(.*?)</pre>', proc.stdout, re.S)
    assert match and match.group(1), proc.stderr[-2000:]
    return json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&")
                      .replace("&lt;", "<").replace("&gt;", ">"))


def test_every_page_fits_at_1400_and_420_px(built_site, tmp_path):
    pages = note_pages(built_site)
    assert "index.html" in pages and "results.html" in pages
    results = measure(built_site, pages, tmp_path)
    assert len(results) == len(pages) * len(WIDTHS)
    problems = [f"{r['page']} at {r['width']} px: {b}"
                for r in results for b in r["bad"]]
    assert not problems, "outside any scroll box:\n" + "\n".join(problems[:40])
    no_font = [r["page"] for r in results if not r["font"]]
    assert not no_font, f"math font not loaded on {no_font[:5]}"
