"""Draw docs/images/chat-page.png: the server's chat page talking to a run, in headless Chromium.

Usage: ``python tools/screenshot_chat.py RUN_DIR [--out docs/images/chat-page.png] [--message TEXT ...]``.
It starts ``lmforge serve --run RUN_DIR`` on a free port, sends each message from the page at temperature 0, waits
for every reply, and saves a screenshot reduced to a 64-colour palette (a few tens of kB). Needs Debian's
``chromium`` and the ``playwright`` package (as tests/serve/test_serve_page.py).
"""

from __future__ import annotations

import argparse
import io
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = ["Use the calculator: what is 123*45?", "How many times does the letter o appear in honour?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"lmforge serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"the server did not answer {url}/health in {seconds:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="the run directory to serve (a chat model)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "images" / "chat-page.png"), help="the PNG to write")
    ap.add_argument("--message", action="append", help="a user message to send (repeatable; default: two tasks)")
    args = ap.parse_args(argv)
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("no chromium on PATH: apt-get install -y chromium")
    from PIL import Image
    from playwright import sync_api

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "serve", "--run", args.run, "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, server)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 900, "height": 560})
            page.goto(url + "/")
            page.fill("#temperature", "0")
            for k, message in enumerate(args.message or MESSAGES):
                page.fill("#input", message)
                page.click("#send")
                sync_api.expect(page.locator(".msg.assistant .content")).to_have_count(k + 1, timeout=60_000)
                sync_api.expect(page.locator("#send")).to_be_enabled(timeout=60_000)
            png = page.screenshot()
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=64)
    image.save(args.out, optimize=True)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
