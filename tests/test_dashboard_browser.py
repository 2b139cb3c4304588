"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright.

It opens ``/dashboard`` on a live server, runs two conversations and a fork through the API while the
page is open, and waits until the panels show them (the page polls; nothing reloads), then a long
turn that the page shows running and then banked. It checks the page
loads nothing from elsewhere, logs no error, fits a 375 px wide screen, reads in the dark colour
scheme, asks for the key when ``--api-key`` is set, and saves ``docs/dashboard.png`` for the README.
With its data held back, the whole layout is there at once; then it explains its terms (a glossary,
tooltips) and shows this CPU's normal ``no_cuda`` state as neutral, not as a warning.

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
LONG_TOKENS = 640  # a turn of several of the page's 1 s polls on a CPU (160 took 0.94 s with drafts)
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


PANELS = [  # every panel's heading, in page order
    "Status",
    "KV memory",
    "Tokens per second",
    "Bank events per second",
    "Conversations",
    "Requests and queue",
    "Attention",
    "Segments, disk tier, speculation",
]
TERMS = ["row", "segment", "shared", "ns", "bank", "fused", "lse", "single", "route_q", "no_cuda", "graphs"]


def _headings(page) -> list[str]:
    return page.eval_on_selector_all("main h2", "hs => hs.map(h => h.firstChild.textContent.trim())")


def _chroma(css: str) -> int:
    """How far a computed ``rgb(...)`` colour is from grey (0: a grey; amber is over 100)."""
    rgb = [int(x) for x in css[css.index("(") + 1 : css.index(")")].split(",")[:3]]
    return max(rgb) - min(rgb)


def test_layout_is_there_before_any_data_and_explains_itself(loaded, browser):
    srv = Live(loaded)
    try:
        chat(srv.client(), [{"role": "user", "content": "Hello."}], max_tokens=2)  # a conversation, routes
        srv.idle()
        ctx = browser.new_context(viewport={"width": 1360, "height": 900})
        page = ctx.new_page()
        watch = Watch(page, srv.url)
        held: list = []
        page.route("**/dashboard/state", lambda route: held.append(route))  # held until we let it go
        page.goto(srv.url + "/dashboard")
        page.wait_for_function("document.readyState === 'complete'")
        page.wait_for_timeout(300)
        assert held, "the page did not ask for its data"
        # before any data: every panel, every summary card, the charts' frames, "—" for each figure
        assert page.is_visible("#main") and page.inner_text("#status") == "connecting…"
        assert _headings(page) == PANELS
        kpis = page.locator("#kpis [data-kpi]")
        assert kpis.count() == 9
        assert page.eval_on_selector_all("#kpis .value", "vs => vs.map(v => v.textContent)") == ["—"] * 9
        for chart in ("#memchart", "#tokchart", "#evchart"):
            assert "waiting for data" in page.inner_text(chart)
        assert page.locator("#queue dd, #attention dd, #segments dd").count() >= 10
        assert set(
            page.eval_on_selector_all("#queue dd, #attention dd", "ds => ds.map(d => d.textContent)")
        ) == {"—"}
        # the glossary is there too, folded; it opens on a click and says what the terms mean
        for term in TERMS:
            assert page.locator(f'#help dt[data-term~="{term}"]').count() == 1, term
        assert page.is_hidden("#help .glossary")
        page.click("#help summary")
        assert page.is_visible("#help .glossary") and "no GPU" in page.inner_text("#help")

        for r in held:  # now the data
            r.continue_()
        page.unroute("**/dashboard/state")
        page.wait_for_selector("#features [data-feature=attention]", timeout=WAIT_MS)
        page.wait_for_selector("#routes [data-route]", timeout=WAIT_MS)
        page.wait_for_selector(CONVS, timeout=WAIT_MS)
        assert _headings(page) == PANELS  # filled in, not rebuilt around
        assert "—" not in page.inner_text("[data-kpi=convs] .value")

        # no_cuda on this CPU: neutral grey, with the reason in words; nothing here is amber
        assert srv.health()["attention"]["verdict"] == "no_cuda"
        attention = page.locator("#features [data-feature=attention]")
        assert attention.get_attribute("data-tone") == "off" and "no GPU" in attention.inner_text()
        shown = page.locator("#main > :not(#help)")  # the glossary shows every colour as a sample
        assert shown.locator(".badge.warn, .badge.bad, .tone-warn, .tone-bad").count() == 0
        off = page.eval_on_selector_all(
            "#main > :not(#help) .badge.off",
            "bs => bs.map(b => [b.textContent, getComputedStyle(b).backgroundColor])",
        )
        assert any("no GPU" in text for text, _ in off)
        assert all(_chroma(bg) < 24 for _, bg in off), off
        verdict = page.locator("#attention .tone-off", has_text="no_cuda")
        assert verdict.count() == 1 and _chroma(verdict.evaluate("e => getComputedStyle(e).color")) < 24
        # tooltips in plain words: the namespace chip, rows, route names, the verdict's row
        assert "namespace" in page.get_attribute("#convs .chip.mono", "title")
        assert "token" in page.locator("#convs .meta span", has_text="rows in").first.get_attribute("title")
        routes = page.eval_on_selector_all(
            "#routes [data-route]", "rs => rs.map(r => [r.textContent, r.title])"
        )
        assert routes and all(
            ("query row" in t or "prompt chunk" in t) and t.startswith(r.split("_")[0]) for r, t in routes
        )
        dt = page.locator("#attention dt", has_text="verdict")
        assert "no_cuda" in dt.get_attribute("title")
        watch.check()
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
