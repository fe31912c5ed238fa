"""The web page at / in a real browser: Debian's headless Chromium, driven by Playwright,
against a real daemon (SmolLM2) that wants an API key.

Every wait polls (Playwright's `expect` and `wait_for_function`) with a generous timeout;
nothing sleeps for a fixed time. The first test also takes the screenshot that the README
shows: set LUCED_PAGE_SCREENSHOT=docs/images/page.png to write it there.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from playwright.sync_api import Browser, Page, expect, sync_playwright

pytestmark = pytest.mark.real_model

KEY = "page-test-key"
WAIT_MS = 180_000  # a generation on two busy cores, with other tests beside it
VIEWPORT = {"width": 1600, "height": 900}
# Recorded before any script of the page runs: what its Content-Security-Policy blocked.
RECORD_CSP = """
window.cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`);
});
"""
LAST_ANSWER = "#messages li.assistant >> nth=-1"


@pytest.fixture(scope="module")
def daemon(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("page")
    # /metrics public: the test reads it without the key (the page never does).
    d = DaemonProcess(smollm2_gguf, tmp, "--metrics-public", env={"LUCED_API_KEY": KEY}).start()
    yield d
    assert d.stop() == 0
    assert d.segments() == []


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is missing: .ci/run installs it")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with sync_playwright() as p:
        # Debian's build, not one Playwright would download.
        b = p.chromium.launch(executable_path=chromium)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.add_init_script(RECORD_CSP)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], "the page's scripts failed"


def get_json(daemon: DaemonProcess, path: str) -> dict:
    req = urllib.request.Request(daemon.url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_streaming_with_text(page: Page) -> None:
    """The last answer is still streaming and already shows text: tokens arrive one by one."""
    page.wait_for_function(
        """() => {
            const m = [...document.querySelectorAll("#messages li.assistant")].at(-1);
            return m && m.dataset.state === "streaming"
                && m.querySelector(".body").textContent.trim().length > 0;
        }""",
        timeout=WAIT_MS,
    )


def test_chat_stop_status_and_plots(daemon: DaemonProcess, page: Page, tmp_path: Path) -> None:
    page.goto(daemon.url)
    # The key is asked for once, and kept for this tab.
    expect(page.locator("#key-dialog")).to_be_visible(timeout=WAIT_MS)
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    expect(page.locator("#state")).to_have_text("ready", timeout=WAIT_MS)
    expect(page.locator("#model")).to_have_value(daemon.model_name, timeout=WAIT_MS)

    # A message, and its answer streamed in.
    page.click("#settings summary")
    page.fill("#temperature", "0")
    send(page, "Write a short Python function that reverses a string.")
    wait_streaming_with_text(page)
    answer = page.locator(LAST_ANSWER)
    expect(answer).to_have_attribute("data-state", "done", timeout=WAIT_MS)
    expect(answer.locator(".meta")).to_contain_text("tokens")
    text = answer.locator(".body").inner_text()
    assert text.strip()

    # The conversation survives a reload, and the key is not asked for again.
    page.reload()
    expect(page.locator("#state")).to_have_text("ready", timeout=WAIT_MS)
    expect(page.locator("#messages li")).to_have_count(2)
    assert page.locator(LAST_ANSWER).locator(".body").inner_text() == text
    expect(page.locator("#key-dialog")).not_to_be_visible()
    assert page.input_value("#temperature") == "0"

    # A long answer: seen running in the status view, then stopped mid-way.
    page.click("#settings summary")
    page.fill("#max_tokens", "3000")
    send(page, "Tell me a long story about a lighthouse keeper and the sea.")
    wait_streaming_with_text(page)
    rows = page.locator("#requests tbody tr")
    expect(rows).to_have_count(1, timeout=WAIT_MS)
    expect(rows.first.locator("td").first).to_have_text("running")
    # Its tokens so far, counting up (some 30 first: text enough for the screenshot).
    page.wait_for_function(
        "() => Number(document.querySelector('#requests tbody td:nth-child(4)')?.textContent) > 30",
        timeout=WAIT_MS,
    )
    shot = tmp_path / "page.png"
    page.screenshot(path=str(shot))
    expect(page.locator("#send")).to_have_text("Stop")
    page.click("#send")
    answer = page.locator(LAST_ANSWER)
    expect(answer).to_have_attribute("data-state", "stopped", timeout=WAIT_MS)
    expect(answer.locator(".meta")).to_contain_text("stopped")
    expect(page.locator("#send")).to_have_text("Send")
    # The daemon let the request go when the page stopped reading.
    expect(page.locator("#idle")).to_be_visible(timeout=WAIT_MS)
    queue = get_json(daemon, "/v1/status")["queue"]
    assert queue["running"] == 0 and queue["requests"] == []
    abort = 'finished_reason="abort"'
    assert daemon.metric("luced:request_success_total", abort) == 1

    # The plots: tokens were generated, and new seconds keep arriving.
    throughput = page.locator("#plot-throughput")
    expect(throughput.locator(".caption")).to_contain_text("tokens/s", timeout=WAIT_MS)
    page.wait_for_function(
        "() => Number(document.querySelector('#plot-throughput').dataset.peak) > 0",
        timeout=WAIT_MS,
    )
    samples = int(throughput.get_attribute("data-samples") or 0)
    page.wait_for_function(
        f"() => Number(document.querySelector('#plot-throughput').dataset.samples) > {samples}",
        timeout=WAIT_MS,
    )
    assert page.evaluate("window.cspViolations") == []

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if target := os.environ.get("LUCED_PAGE_SCREENSHOT"):
        shutil.copyfile(shot, target)


def test_markdown_is_rendered_and_made_safe(daemon: DaemonProcess, page: Page) -> None:
    page.add_init_script(f"sessionStorage.setItem('luced.apiKey', {json.dumps(KEY)})")
    page.goto(daemon.url)
    expect(page.locator("#state")).to_have_text("ready", timeout=WAIT_MS)
    markdown = "\n\n".join(
        [
            "# Title",
            "**bold** and `code`",
            "```python\nprint('hi')\n```",
            "<img src=x onerror=alert(1)> <script>alert(2)</script>",
            "[a link](javascript:alert(3)) [another](https://example.com)",
        ]
    )
    out = page.evaluate(
        """async (text) => {
            const { renderMarkdown } = await import("/static/markdown.js");
            const div = document.createElement("div");
            div.append(renderMarkdown(text));
            return {
                html: div.innerHTML,
                text: div.textContent,
                unsafe: div.querySelectorAll("img, script, [onerror], [href^='javascript']").length,
                links: [...div.querySelectorAll("a")].map((a) => [a.href, a.target, a.rel]),
            };
        }""",
        markdown,
    )
    assert "<h1>Title</h1>" in out["html"] and "<strong>bold</strong>" in out["html"]
    assert '<code class="language-python">' in out["html"]
    assert out["unsafe"] == 0
    assert "<img src=x onerror=alert(1)>" in out["text"]  # raw HTML is shown as text
    assert ["https://example.com/", "_blank", "noopener noreferrer"] in out["links"]
    assert page.evaluate("window.cspViolations") == []


class _ForeignSite(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>another site</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_foreign_origin_is_refused(daemon: DaemonProcess, page: Page) -> None:
    site = ThreadingHTTPServer(("127.0.0.1", 0), _ForeignSite)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        origin = f"http://127.0.0.1:{site.server_address[1]}"
        page.goto(origin + "/")
        # Another site's script, even one that knows the key, gets nothing from the daemon.
        results = page.evaluate(
            """async ([url, key]) => {
                const headers = {
                    "Content-Type": "application/json",
                    Authorization: "Bearer " + key,
                };
                const body = JSON.stringify({ messages: [{ role: "user", content: "hi" }] });
                const tries = [
                    fetch(url + "/v1/models"),
                    fetch(url + "/v1/chat/completions", { method: "POST", headers, body }),
                ];
                const said = (t) => t.then((r) => `answered ${r.status}`, (e) => `refused: ${e}`);
                return Promise.all(tries.map(said));
            }""",
            [daemon.url, KEY],
        )
        assert all(r.startswith("refused") for r in results), results
        # The daemon itself says no (the browser's CORS check is not the only wall).
        req = urllib.request.Request(daemon.url + "/v1/models", headers={"Origin": origin})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 403
        assert "--allowed-origins" in json.loads(info.value.read())["error"]["message"]
    finally:
        site.shutdown()
        site.server_close()
        thread.join()
