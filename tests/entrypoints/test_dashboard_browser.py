"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, through selenium)
against a real `pagedllm serve --api-key` on loopback. What the page shows is compared with the
server's own /metrics and /v1/kv_map, polled until they agree (never a guessed sleep). The server is the
fault-injection launcher, whose hold freezes the engine while the page is hovered and plotted under load.
The last test stops the server and watches the page say so; a screenshot is taken under load
(docs/dashboard.png with PAGEDLLM_UPDATE_DOCS=1)."""
from __future__ import annotations

import os
import random
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from benchmarks.reliability import faults
from benchmarks.reliability.fault_markers import FAULT_INJECTION_LAUNCHER
from pagedllm.bench.server_process import ServerProcess, poll

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (scripts/setup.sh --tests installs it)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                reason="Chromium and chromedriver are absent (apt-get install chromium "
                                       "chromium-driver; scripts/setup.sh --tests does it where apt works)")

API_KEY = "dashboard-key"
TIMEOUT = 120   # seconds: a generous bound for what the page must come to show
# The README's screenshot is rewritten only when asked (PAGEDLLM_UPDATE_DOCS=1), so a test run leaves the checkout
# as it found it.
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
# Three full blocks of 16 tokens and a partial one, so the samples of n = 4 share full blocks.
PROMPT = ("In the harbour town the lighthouse keeper climbed the spiral stairs every evening, counting each "
          "of the hundred steps aloud, and lit the great lamp that guided the fishing boats home.")
STEP_TOKENS = 64   # the engine's token budget per step: a longer prompt's prefill takes several steps


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("dashboard") / "server.log", "--kv-cache-memory", "128MiB",
                            "--max-model-len", "2048", "--max-num-batched-tokens", str(STEP_TOKENS),
                            "--served-model-name", "smollm2", api_key=API_KEY, launcher=FAULT_INJECTION_LAUNCHER)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def browser(server):
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.get(f"{server.url}/dashboard")
    driver.find_element("id", "key-input").send_keys(API_KEY)   # the page asks for the key first
    driver.find_element("css selector", "#key-form button").click()
    assert poll(lambda: driver.find_element("id", "status").text, lambda text: text == "live", TIMEOUT) == "live"
    yield driver
    driver.quit()


def page_counts(browser) -> dict[str, int]:
    return browser.execute_script("return window.kvDashboard.counts()")


def page_codes(browser) -> list[int]:
    return browser.execute_script("return Array.from(window.kvDashboard.state.codes)")


def stream_in_background(server, prompt: str = PROMPT, **body) -> threading.Thread:
    """A streamed completion read to its end on another thread, so the test can watch the page meanwhile."""
    def run():
        with httpx.Client(timeout=TIMEOUT) as client, client.stream(
                "POST", f"{server.url}/v1/completions", headers=server.headers,
                json={"model": "smollm2", "prompt": prompt, "stream": True, "ignore_eos": True, **body}) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                pass
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def used_blocks_in_metrics(server) -> int:
    figures = server.engine_figures()
    return int(figures.total_blocks - figures.free_blocks)


def test_page_loads_without_console_errors_and_shows_every_block(server, browser):
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []
    total = int(server.engine_figures().total_blocks)
    assert browser.execute_script("return window.kvDashboard.state.numBlocks") == total
    assert sum(page_counts(browser).values()) == total
    assert browser.find_element("id", "cell-count").text.startswith(f"{total} blocks")


def running_requests(server) -> int:
    return int(server.engine_figures().running)


def test_streaming_requests_show_in_use_cells_matching_metrics_and_shared_ones(server, browser, tmp_path):
    """Four samples of one prompt and three other requests decode; then a request longer than a step's token
    budget is held by the launcher part-way through its prefill. The engine skips its steps from then on, so
    all of them stay in flight, holding their blocks, while the test hovers a shared block and the page
    gathers the frames of its plots; closing the held stream ends the hold and the others run to their end."""
    threads = [stream_in_background(server, n=4, temperature=1.0, max_tokens=300),
               *(stream_in_background(server, f"Story {index}: {PROMPT}", max_tokens=300) for index in range(3))]
    try:
        assert poll(lambda: running_requests(server), lambda running: running == 7, TIMEOUT) == 7
        hold_prompt = faults.unique_prompt(random.Random(5), 5 * STEP_TOKENS)
        with faults.held_prefill(server, "smollm2", hold_prompt) as held:
            assert held, "the launcher never held the engine"
            # Nothing finished before the hold (300 tokens each against the few steps it took): 7 + the held one.
            assert running_requests(server) == 8

            def agreement():
                counts = page_counts(browser)
                page_used = counts["in_use"] + counts["shared"] + counts["copying"]
                return page_used, used_blocks_in_metrics(server), max(page_codes(browser)) >> 1
            page_used, metrics_used, top_ref = poll(agreement, lambda a: a[0] == a[1] > 0 and a[2] == 4, TIMEOUT)
            assert page_used == metrics_used > 0
            assert top_ref == 4                                   # the prompt's full blocks, held by 4 samples
            # The tooltip of a shared block names its owners as /v1/kv_map does.
            codes = page_codes(browser)
            block_id = codes.index(max(codes))
            owners = httpx.get(f"{server.url}/v1/kv_map", headers=server.headers).json()["blocks"][block_id]["owners"]
            tooltip = hover(browser, block_id)
            assert f"block {block_id}" in tooltip and "ref count 4" in tooltip
            assert all(owner in tooltip for owner in owners) and len(owners) == 4
            # The screenshot, once the page lists every request and has 25 frames of plots.
            shown = poll(lambda: browser.execute_script(
                "return [document.querySelectorAll('#requests tbody tr').length, "
                "window.kvDashboard.state.history.length]"), lambda shown: shown[0] >= 8 and shown[1] >= 25, TIMEOUT)
            assert shown[0] >= 8 and shown[1] >= 25, shown
            assert faults.hold_counts(server)["held"], "the hold ended before the page was read"
            screenshot = DOCS_SCREENSHOT if os.environ.get("PAGEDLLM_UPDATE_DOCS") else tmp_path / "dashboard.png"
            browser.save_screenshot(str(screenshot))
            assert screenshot.stat().st_size > 10_000
    finally:
        for thread in threads:
            thread.join()


def test_a_repeated_prompt_shows_prefix_cache_hits(server, browser):
    stream_in_background(server, max_tokens=4).join()
    # Until the page has dropped the finished requests' rows, one of them (a hit itself) could be taken for the new one.
    assert poll(lambda: browser.execute_script("return window.kvDashboard.state.rows.size"), lambda size: size == 0,
                TIMEOUT) == 0
    thread = stream_in_background(server, max_tokens=150)
    try:
        def hit_rows():
            rows = browser.execute_script("return Array.from(window.kvDashboard.state.rows.values())")
            return [row for row in rows if row["num_cached_tokens"] > 0]
        rows = poll(hit_rows, bool, TIMEOUT)
        assert rows, "no request row showed prefix-cache hits"
        table = browser.execute_script("return window.kvDashboard.state.tables.get(arguments[0])", rows[0]["request_id"])
        tooltip = poll(lambda: hover(browser, table[0]), lambda text: "prefix-cache hit: yes" in text, TIMEOUT)
        assert "prefix-cache hit: yes" in tooltip and rows[0]["request_id"] in tooltip
        # The table is re-rendered every frame, so its row is read in one script call (no element handle to go stale).
        expected = f"{rows[0]['num_cached_tokens'] // 16} blocks"
        row_text = poll(lambda: browser.execute_script(
            "const row = document.querySelector(`#requests tr[data-request-id=\"${arguments[0]}\"]`);"
            "return row ? row.innerText : ''", rows[0]["request_id"]), lambda text: expected in text, TIMEOUT)
        assert expected in row_text
    finally:
        thread.join()


def test_after_the_load_every_cell_is_free_or_cached_idle(server, browser):
    counts = poll(lambda: page_counts(browser), lambda c: c["in_use"] + c["shared"] + c["copying"] == 0, TIMEOUT)
    assert counts["in_use"] == counts["shared"] == counts["copying"] == 0
    assert counts["cached_idle"] > 0 and server.wait_until_idle().idle


def test_the_page_says_when_the_server_is_gone(server, browser):
    server.stop()
    status = poll(lambda: browser.find_element("id", "status").text, lambda text: text.startswith("disconnected"),
                  TIMEOUT)
    assert status.startswith("disconnected")


def hover(browser, block_id: int) -> str:
    """Moves the mouse over the block's cell and returns the tooltip's text."""
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = browser.find_element("id", "map")
    rect = browser.execute_script("return window.kvDashboard.cellRect(arguments[0])", block_id)
    size = canvas.size
    ActionChains(browser).move_to_element_with_offset(canvas, 0, 0).perform()   # leave, so a new hover starts
    ActionChains(browser).move_to_element_with_offset(
        canvas, round(rect["x"] - size["width"] / 2), round(rect["y"] - size["height"] / 2)).perform()
    return poll(lambda: browser.find_element("id", "tooltip").text,
                lambda text: f"block {block_id}:" in text and "tokens: ..." not in text, TIMEOUT)
