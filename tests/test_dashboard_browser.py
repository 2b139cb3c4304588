"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright.

It opens ``/dashboard`` on a live server, runs two conversations and a fork through the API while the
page is open, and waits until the panels show them (the page polls; nothing reloads), then a long
turn that the page shows running and then banked. It checks the page
loads nothing from elsewhere, logs no error, fits a 375 px wide screen, reads in the dark colour
scheme, asks for the key when ``--api-key`` is set, and saves ``docs/dashboard.png`` for the README.

Needs the ``chromium`` binary (``apt-get install chromium``; ``.ci/run`` installs it). Playwright
never downloads a browser here: it drives the system one.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from playwright.sync_api import expect
from test_dashboard import SECRET, TOPICS, run_conversations
from test_server import Live, chat

from turnkv.models.load import load_model

CHROMIUM = os.environ.get("TURNKV_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(CHROMIUM).is_file(),
        reason=f"no chromium binary at {CHROMIUM}: apt-get install -y chromium (.ci/run does)",
    ),
]
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
]
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"
WAIT_MS = 30_000
LONG_TOKENS = 160  # a turn long enough (seconds on a CPU) for the page to see it running
CONVS = "#convs [data-conv]"  # one element per banked conversation


@pytest.fixture(scope="module")
def loaded():
    return load_model("default", "cpu", "auto", progress=False)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright  # a dev dependency; drives the system chromium

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


class Watch:
    """Every request the page makes and every console error or page exception it raises."""

    def __init__(self, page, origin: str) -> None:
        self.origin = origin
        self.urls: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def check(self) -> None:
        assert self.urls, "the page made no request"
        foreign = [u for u in self.urls if not (u.startswith(self.origin + "/") or u.startswith("data:"))]
        assert not foreign, foreign
        assert not self.errors, self.errors


def conversations_shown(page) -> int:
    return page.locator(CONVS).count()


def test_page_follows_two_conversations_live(loaded, browser):
    srv = Live(loaded)
    try:
        ctx = browser.new_context(viewport={"width": 1360, "height": 900}, device_scale_factor=1)
        page = ctx.new_page()
        watch = Watch(page, srv.url)
        page.goto(srv.url + "/dashboard")
        page.wait_for_selector("#main:not([hidden])", timeout=WAIT_MS)
        assert conversations_shown(page) == 0
        page.wait_for_selector("text=Nothing banked yet", timeout=WAIT_MS)
        loads = page.evaluate("performance.getEntriesByType('navigation').length")

        done = threading.Event()
        histories: list = []

        def talk() -> None:
            try:
                histories.extend(run_conversations(srv.client(), max_tokens=16)[0])
                fork = [*histories[0][:-2], {"role": "user", "content": "And the charts?"}]
                chat(srv.client(), fork, max_tokens=16)
            finally:
                done.set()

        threading.Thread(target=talk, daemon=True).start()
        # conversations appear as they are banked, while the page stays open
        page.wait_for_selector("#convs [data-conv]", timeout=WAIT_MS * 4)
        assert done.wait(timeout=240)
        srv.idle()
        entries = srv.health()["bank"]["entries"]
        assert entries == len(TOPICS) + 1  # two conversations and a fork of the first
        expect(page.locator(CONVS)).to_have_count(entries, timeout=WAIT_MS)
        page.wait_for_selector("#convs .seg[data-shared='1']", timeout=WAIT_MS)  # the shared prompt
        page.wait_for_selector("#routes .hbars", timeout=WAIT_MS)
        page.wait_for_timeout(2500)  # a few more samples for the charts, then the picture
        assert page.evaluate("performance.getEntriesByType('navigation').length") == loads  # no reload
        shown = page.evaluate(
            "[...document.querySelectorAll('#convs [data-conv]')].map(e => +e.dataset.rows)"
        )
        shown.sort()
        banked = sorted(c["rows"] for c in _state(srv)["conversations"])
        assert shown == banked
        kpis = page.inner_text("#kpis")
        assert "Conversations" in kpis and str(entries) in kpis

        # a long follow-up of the second conversation: the page shows it live, then banked
        long_done = threading.Event()
        follow = [*histories[1], {"role": "user", "content": "Read me the whole ledger, slowly."}]

        def long_turn() -> None:
            try:
                chat(srv.client(), follow, max_tokens=LONG_TOKENS, extra_body={"ignore_eos": True})
            finally:
                long_done.set()

        threading.Thread(target=long_turn, daemon=True).start()
        page.wait_for_selector("#live tbody tr", timeout=WAIT_MS)
        page.wait_for_selector("#convs .chip.pin", timeout=WAIT_MS)  # the conversation it continues
        page.wait_for_timeout(1500)  # the live band in the memory chart
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        assert long_done.wait(timeout=240)
        srv.idle()
        page.wait_for_selector("#live .none", timeout=WAIT_MS)  # "No turn running."
        expect(page.locator(CONVS)).to_have_count(entries, timeout=WAIT_MS)  # the longer one replaced it
        watch.check()

        # narrow (a phone) and dark: everything fits the width, the colours follow the scheme
        narrow = browser.new_context(viewport={"width": 375, "height": 800}, color_scheme="dark")
        phone = narrow.new_page()
        watch_phone = Watch(phone, srv.url)
        phone.goto(srv.url + "/dashboard")
        expect(phone.locator(CONVS)).to_have_count(entries, timeout=WAIT_MS)
        assert phone.evaluate("document.documentElement.scrollWidth") <= 375
        bg = phone.evaluate("getComputedStyle(document.body).backgroundColor")
        fg = phone.evaluate("getComputedStyle(document.body).color")
        assert _luminance(bg) < 0.1 and _luminance(fg) > 0.6, (bg, fg)
        light_bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert _luminance(light_bg) > 0.8
        watch_phone.check()
        narrow.close()
        ctx.close()
    finally:
        srv.close()


def test_page_asks_for_the_api_key(loaded, browser):
    srv = Live(loaded, api_key=[SECRET])
    try:
        ctx = browser.new_context(viewport={"width": 1000, "height": 700})
        page = ctx.new_page()
        watch = Watch(page, srv.url)
        page.goto(srv.url + "/dashboard")
        page.wait_for_selector("#keyform:not([hidden])", timeout=WAIT_MS)
        assert page.is_hidden("#main")
        page.fill("#key", "wrong-key")
        page.click("#keyform button")
        page.wait_for_selector("#keyerror:not([hidden])", timeout=WAIT_MS)
        page.fill("#key", SECRET)
        page.click("#keyform button")
        page.wait_for_selector("#main:not([hidden])", timeout=WAIT_MS)
        assert SECRET not in page.content()
        # the fragment form: the key is taken and removed from the address bar
        other = ctx.new_page()
        other.goto(srv.url + "/dashboard#key=" + SECRET)
        other.wait_for_selector("#main:not([hidden])", timeout=WAIT_MS)
        assert SECRET not in other.url
        # the two 401s of the wrong key are expected console errors of the fetch; nothing else
        watch.errors = [e for e in watch.errors if "401" not in e]
        watch.check()
        ctx.close()
    finally:
        srv.close()


def _state(srv: Live) -> dict:
    import httpx

    return httpx.get(srv.url + "/dashboard/state", timeout=30).json()


def _luminance(css: str) -> float:
    """Relative luminance (0 black .. 1 white) of a computed ``rgb(r, g, b)`` colour."""
    r, g, b = (int(x) / 255 for x in css[css.index("(") + 1 : css.index(")")].split(",")[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b
