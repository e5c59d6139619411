"""The web chat page in a real headless browser: Chromium (Debian's ``chromium``) driven by Playwright.

Install the browser with ``apt-get install -y chromium`` (Playwright's own browser download is not used); the
test skips with the reason when either is missing. The server runs a hand-set model whose reply is
``<script>alert('pwned')</script>``, streamed as three pieces: the page must show it as text.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install playwright")

from lmforge.serve import ServedModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import ThreadServer, script_run  # noqa: E402

REPLY = "<script>alert('pwned')</script>"


@pytest.fixture(scope="module")
def chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium on PATH: apt-get install -y chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield browser
        browser.close()


@contextlib.contextmanager
def open_page(chromium, server: ThreadServer, model: str | None = None, dialogs: list[str] | None = None):
    """The chat page of ``server`` in a new tab (once it shows ``model``, if given); closes both after.
    ``dialogs``: collects the message of every dialog the page opens, from the moment it loads."""
    page = chromium.new_page()
    if dialogs is not None:
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    try:
        page.goto(server.url + "/")
        if model is not None:
            page.wait_for_function(f"document.getElementById('model').textContent === '{model}'")
        yield page
    finally:
        page.close()
        server.close()


def test_page_streams_the_reply_as_text_and_starts_new_chats(chromium, tmp_path):
    s = ThreadServer(ServedModel.from_run(script_run(tmp_path / "scripted")))
    dialogs: list[str] = []
    with open_page(chromium, s, "scripted", dialogs) as page:
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
        page.fill("#temperature", "0")
        page.fill("#input", "Say something dangerous")
        page.click("#send")
        reply = page.locator(".msg.assistant .content")
        sync_api.expect(reply).to_have_text(REPLY, timeout=30_000)
        sync_api.expect(page.locator("#send")).to_be_enabled()
        assert page.locator(".msg.user .content").inner_text() == "Say something dangerous"
        assert "&lt;script&gt;" in reply.inner_html()  # shown as text: escaped, never parsed
        assert page.locator("#messages script").count() == 0 and not dialogs
        assert sent[0]["stream"] is True and sent[0]["temperature"] == 0 and "max_tokens" not in sent[0]
        assert sent[0]["messages"] == [{"role": "user", "content": "Say something dangerous"}]
        # a second turn carries the history; then "New chat" clears it
        page.fill("#input", "Again")
        page.press("#input", "Enter")
        sync_api.expect(page.locator(".msg.assistant .content")).to_have_count(2)
        sync_api.expect(page.locator(".msg.assistant .content").nth(1)).to_have_text(REPLY, timeout=30_000)
        assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
        assert sent[1]["messages"][1]["content"] == REPLY
        page.click("#new-chat")
        assert page.locator(".msg").count() == 0


def test_page_shows_server_errors(chromium, tmp_path):
    """An error answer (here: max tokens over the context) is shown in the conversation, as text."""
    s = ThreadServer(ServedModel.from_run(script_run(tmp_path / "scripted")))
    with open_page(chromium, s, "scripted") as page:
        page.fill("#max-tokens", "5000")
        page.fill("#input", "hello")
        page.click("#send")
        err = page.locator(".msg.error .content")
        sync_api.expect(err).to_contain_text("context length is 256", timeout=30_000)
        sync_api.expect(page.locator("#stop")).to_be_disabled()


def test_stop_button_ends_the_reply_and_frees_the_row(chromium, tmp_path):
    """A long reply (the all-zero model repeats one token for thousands of steps) stopped from the page: the
    browser drops the stream, the server frees the request's row at once, and the stopped exchange is left out
    of the history the next message sends (a cut reply is not a finished answer)."""
    import httpx

    from serve_helpers import wide_zero_run

    # wide layers: a few ms per token, so the reply runs for seconds even on a quiet machine (the small model wrote
    # its 4k tokens in ~2 s, racing the click) without flooding the page with thousands of tokens per second
    s = ThreadServer(ServedModel.from_run(wide_zero_run(tmp_path / "zero")))
    with open_page(chromium, s, "zero") as page:
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
        page.fill("#temperature", "0")
        page.fill("#input", "Talk forever")
        page.click("#send")
        page.wait_for_function("document.querySelector('.msg.assistant .content').textContent.length > 3")
        assert httpx.get(s.url + "/health", trust_env=False).json()["active"] == 1
        state = page.evaluate("""() => [document.getElementById('stop').disabled,
            document.getElementById('status').textContent, document.querySelector('.msg.assistant').className,
            document.querySelector('.msg.assistant .content').textContent.replace(/\\u0000/g, '').slice(-300)]""")
        assert state[0] is False, f"the reply ended before Stop was clicked: {state}"
        page.click("#stop")
        sync_api.expect(page.locator("#status")).to_have_text(re.compile("^stopped"))
        sync_api.expect(page.locator("#send")).to_be_enabled()
        page.wait_for_function("""async () => (await (await fetch('/health')).json()).active === 0""",
                               timeout=10_000)
        assert page.locator(".msg.unsent").count() == 2  # shown greyed: the question and the cut reply
        page.fill("#max-tokens", "3")
        page.fill("#input", "Once more")
        page.click("#send")
        sync_api.expect(page.locator(".msg.assistant .content").nth(1)).to_have_text("\x00" * 3, timeout=30_000)
        assert sent[1]["messages"] == [{"role": "user", "content": "Once more"}]


def test_a_failed_reply_is_left_out_of_the_history(chromium, tmp_path, monkeypatch):
    """A reply that fails half-way (a fault injected into its row after its first token) shows the error and is
    not sent back as a finished answer with the next message."""
    s = ThreadServer(ServedModel.from_run(script_run(tmp_path / "scripted")))
    calls = []

    def failing_tool():
        def feed(token: int) -> None:
            calls.append(token)
            if len(calls) == 2:
                raise RuntimeError("injected fault")
        return feed

    monkeypatch.setattr(s.served, "chat_tool", failing_tool)
    with open_page(chromium, s, "scripted") as page:
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
        page.fill("#temperature", "0")
        page.fill("#input", "first")
        page.click("#send")
        sync_api.expect(page.locator(".msg.error .content")).to_contain_text("injected fault", timeout=30_000)
        assert page.locator(".msg.error .content").inner_text().startswith("<script>")  # the part that came
        sync_api.expect(page.locator("#send")).to_be_enabled()
        monkeypatch.undo()
        page.fill("#input", "second")
        page.click("#send")
        sync_api.expect(page.locator(".msg.assistant .content").nth(1)).to_have_text(REPLY, timeout=30_000)
        assert sent[1]["messages"] == [{"role": "user", "content": "second"}]


def test_page_round_trips_a_calculator_call_to_the_chat_formats_ids(chromium, tmp_path, monkeypatch):
    """The page shows a calculator call in the server's markup and sends it back as it came; the server renders
    the next prompt exactly as ChatFormat renders the structured conversation (the call's special ids)."""
    from lmforge.chat import ChatFormat
    from serve_helpers import calculator_run, recorded_prompts

    s = ThreadServer(ServedModel.from_run(calculator_run(tmp_path / "calc", then="!")))
    prompts = recorded_prompts(s.served, monkeypatch)
    shown = "<calculator>6*7</calculator><output>42</output>!"
    with open_page(chromium, s, "calc") as page:
        page.fill("#temperature", "0")
        for k, text in enumerate(["What is 6*7?", "Again"]):
            page.fill("#input", text)
            page.click("#send")
            sync_api.expect(page.locator(".msg.assistant .content").nth(k)).to_have_text(shown, timeout=30_000)
            sync_api.expect(page.locator("#send")).to_be_enabled()
    structured = [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": "", "tool_call": "6*7"},
                  {"role": "tool", "content": "42"}, {"role": "assistant", "content": "!"},
                  {"role": "user", "content": "Again"}]
    assert prompts[1] == ChatFormat(s.served.tokenizer).render_for_completion(structured)


def test_page_sends_the_api_key_when_the_server_wants_one(chromium, tmp_path):
    s = ThreadServer(ServedModel.from_run(script_run(tmp_path / "scripted")), api_key="page-key")
    with open_page(chromium, s) as page:
        sync_api.expect(page.locator("#key-label")).to_be_visible()
        page.fill("#input", "hello")
        page.click("#send")
        sync_api.expect(page.locator(".msg.error .content")).to_contain_text("API key", timeout=30_000)
        page.fill("#api-key", "page-key")
        page.fill("#input", "hello again")
        page.click("#send")
        sync_api.expect(page.locator(".msg.assistant:not(.error) .content")).to_have_text(REPLY, timeout=30_000)


@pytest.mark.serial
def test_page_draws_a_fast_stream_at_most_once_per_frame(chromium, tmp_path):
    """Thousands of tokens per second must not each rewrite the reply: the page draws once per animation frame
    (counted beside the reply's DOM writes), and the whole reply is there at the end."""
    from serve_helpers import zero_run

    s = ThreadServer(ServedModel.from_run(zero_run(tmp_path / "zero")))
    with open_page(chromium, s, "zero") as page:
        page.evaluate("""() => {
            window.counts = { writes: 0, frames: 0, live: true };
            new MutationObserver((records) => {
                for (const r of records) {
                    const el = r.target.nodeType === 1 ? r.target : r.target.parentElement;
                    if (el && el.closest('.msg.assistant')) window.counts.writes++;
                }
            }).observe(document.getElementById('messages'), { childList: true, subtree: true, characterData: true });
            const tick = () => { window.counts.frames++; if (window.counts.live) requestAnimationFrame(tick); };
            requestAnimationFrame(tick);
        }""")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "1500")
        page.fill("#input", "Talk")
        page.click("#send")
        sync_api.expect(page.locator("#status")).to_have_text("stopped at max tokens", timeout=60_000)
        counts = page.evaluate("() => { window.counts.live = false; return window.counts; }")
        text = page.evaluate("() => document.querySelector('.msg.assistant .content').textContent")
        assert len(text) == 1500, len(text)  # every token arrived (the zero model repeats one 1-byte token)
        # a write per frame at most (+1 for adding the message, +1 for the final flush, +2 for frame-edge slack)
        assert counts["writes"] <= counts["frames"] + 4, counts
