"""The browser chat page at `/`, in headless Chromium driven over the DevTools protocol.

Debian's `chromium` (scripts/setup.sh installs it) talks CDP over a WebSocket, which the
`websockets` package already in the environment speaks, so no browser driver is needed.
One stack and one browser serve the whole module.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets.sync.client
from service_stack import ServiceStack, fresh_stack

from rill.shared.bus import FIELD
from rill.shared.schema import GenerateRequest, generate_decoder

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1100,900", "--remote-debugging-port=0"]
ALLOWED_TAGS = {"ARTICLE", "DIV", "P", "BR", "STRONG", "CODE", "PRE", "DETAILS", "SUMMARY"}  # what the page builds


class Page:
    """A minimal Chrome DevTools Protocol client for one page target."""

    def __init__(self, ws_url: str) -> None:
        # __enter__: the connection itself, on every websockets version (17.1 warns without it).
        self.ws = websockets.sync.client.connect(ws_url, max_size=None, open_timeout=30).__enter__()
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:  # events we did not subscribe to are dropped
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise AssertionError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {what or expression}"
            time.sleep(0.05)

    def close(self) -> None:
        self.ws.close()


@pytest.fixture(scope="module")
def stack(redis_url: str, smollm2_dir: str) -> Iterator[ServiceStack]:
    # qwen3's parser changes nothing for output that does not open with <think> (every test but one).
    with fresh_stack(redis_url, smollm2_dir, "web", ["--reasoning-parser", "qwen3"]) as st:
        yield st


@pytest.fixture(scope="module")
def page(stack: ServiceStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it with apt)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"  # Chromium writes its chosen port here
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert proc.poll() is None, "chromium exited during start-up"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            target = next(t for t in json.load(resp) if t["type"] == "page")
        pg = Page(target["webSocketDebuggerUrl"])
        pg.call("Page.enable")
        pg.call("Page.navigate", url=f"{stack.base_url}/")
        pg.wait_for("document.readyState === 'complete' && !!window.rillChat", what="the page to load")
        pg.wait_for("document.getElementById('conn').dataset.state === 'open'", what="the socket to open")
        yield pg
        pg.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def set_field(page: Page, field: str, value: str) -> None:
    page.js(f"(() => {{ const el = document.getElementById({json.dumps(field)}); el.value = {json.dumps(value)};"
            f" el.dispatchEvent(new Event('change')); }})()")


def send_message(page: Page, text: str) -> None:
    """Type into the box and press Enter, as a person would."""
    page.js("document.getElementById('input').focus()")
    page.call("Input.insertText", text=text)
    for kind in ("keyDown", "keyUp"):
        page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                  **({"text": "\r"} if kind == "keyDown" else {}))


def click(page: Page, element_id: str) -> None:
    box = page.js(f"(() => {{ const r = document.getElementById({json.dumps(element_id)}).getBoundingClientRect();"
                  " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    for kind in ("mousePressed", "mouseReleased"):
        page.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)


LAST_REPLY = "[...document.querySelectorAll('.msg.assistant')].at(-1)"


def watch_replies(page: Page) -> None:
    """From now on, record the last reply's text length at every DOM change (in the page, so no step is missed)."""
    page.js(f"""(() => {{
        window.__steps = [];
        new MutationObserver(() => {{
            const last = {LAST_REPLY};
            if (last) window.__steps.push(last.querySelector('.body').textContent.length);
        }}).observe(document.getElementById('log'), {{childList: true, subtree: true, characterData: true}});
    }})()""")


def sent_requests(stack: ServiceStack) -> list[GenerateRequest]:
    """What the gateway queued for the tokenizers, read back from Redis."""
    entries = stack.sent_requests()
    return [generate_decoder.decode(fields[FIELD]) for _, fields in entries]


def test_page_and_static_files_are_served(stack: ServiceStack) -> None:
    with urllib.request.urlopen(f"{stack.base_url}/", timeout=10) as resp:
        html = resp.read().decode()
        csp = resp.headers["Content-Security-Policy"]
    assert resp.headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert '<script src="/static/app.js"' in html
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        with urllib.request.urlopen(f"{stack.base_url}/static/{name}", timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith(kind)
            assert len(resp.read()) > 500
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{stack.base_url}/static/..%2Fapp.py", timeout=10)
    assert missing.value.code == 404
    # The page never hands text to the HTML parser.
    with urllib.request.urlopen(f"{stack.base_url}/static/app.js", timeout=10) as resp:
        assert not re.search(r"\.(innerHTML|outerHTML)\s*=|insertAdjacentHTML|document\.write", resp.read().decode())


def test_chat_streams_then_stop_cancels(page: Page, stack: ServiceStack, tmp_path: Path) -> None:
    set_field(page, "temperature", "0")
    set_field(page, "max_tokens", "12")
    watch_replies(page)
    send_message(page, "Name three colours of the rainbow.")
    page.wait_for(f"{LAST_REPLY} && {LAST_REPLY}.dataset.state === 'done'", 120, "the first reply to finish")
    steps = page.js("window.__steps")
    growth = sorted({n for n in steps if n > 0})
    assert len(growth) >= 3, f"the reply did not stream in several steps: {steps}"
    meta = page.js(f"{LAST_REPLY}.querySelector('.meta').textContent")
    assert "TTFT" in meta and "tok/s" in meta and "12 tokens" in meta, meta
    # What the page shows is what the server generated (temperature 0: the same as over HTTP).
    first = page.js("window.rillChat.history[1].content")
    body = json.dumps({"messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
                       "temperature": 0, "max_tokens": 12}).encode()
    req = urllib.request.Request(f"{stack.base_url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert json.load(resp)["choices"][0]["message"]["content"] == first

    # A second, long reply: the stop button cancels it mid-stream.
    set_field(page, "max_tokens", "400")
    send_message(page, "Write a long story about a dragon who learns to bake bread.")
    page.wait_for(f"{LAST_REPLY}.dataset.state === 'streaming' && {LAST_REPLY}.querySelector('.body')"
                  ".textContent.length > 20", 120, "the second reply to stream")
    assert page.js("!document.getElementById('stop').hidden")
    click(page, "stop")
    page.wait_for(f"{LAST_REPLY}.dataset.state === 'stopped'", 30, "the reply to stop")
    stopped_len = page.js(f"{LAST_REPLY}.querySelector('.body').textContent.length")
    time.sleep(1.5)
    assert page.js(f"{LAST_REPLY}.querySelector('.body').textContent.length") == stopped_len
    assert "stopped" in page.js(f"{LAST_REPLY}.querySelector('.meta').textContent")
    assert page.js("!document.getElementById('send').hidden && document.getElementById('stop').hidden")
    st = stack.wait_idle()
    assert st.num_running == 0 and st.num_waiting == 0 and st.aborted_requests >= 1
    # Multi-turn: the second request carried the first exchange.
    second = sent_requests(stack)[-1]
    assert [(m.role, m.content) for m in second.messages or []] == [
        ("user", "Name three colours of the rainbow."), ("assistant", first),
        ("user", "Write a long story about a dragon who learns to bake bread.")]
    shot = page.call("Page.captureScreenshot", format="png")
    (tmp_path / "chat.png").write_bytes(base64.b64decode(shot["data"]))
    assert (tmp_path / "chat.png").stat().st_size > 10_000


def test_model_output_is_shown_as_text(page: Page, tmp_path: Path) -> None:
    """HTML in model output stays text: checked on a real reply and on hostile text given to the renderer."""
    page.js("document.getElementById('new-chat').click()")  # one turn: the same greedy reply every time
    assert page.js("window.rillChat.history.length") == 0
    set_field(page, "temperature", "0")
    set_field(page, "max_tokens", "16")
    send_message(page, "Show an HTML example of a script tag that logs hello.")
    page.wait_for(f"{LAST_REPLY}.dataset.state !== 'streaming'", 120, "the reply to finish")
    raw = page.js("window.rillChat.history.at(-1).content")
    assert "<script>" in raw, f"the model did not write a script tag this time: {raw!r}"
    shown = page.js(f"{LAST_REPLY}.querySelector('.body').textContent")
    assert "<script>" in shown
    tags = set(page.js("[...document.querySelectorAll('#log *')].map(e => e.tagName)"))
    assert tags <= ALLOWED_TAGS, tags
    page.js("document.getElementById('settings').open = true")
    (tmp_path / "script-reply.png").write_bytes(base64.b64decode(page.call("Page.captureScreenshot")["data"]))

    hostile = ('Hi <script>window.__pwned = 1</script> <img src=x onerror="window.__pwned = 2"> '
               '**bold** and `<b>code</b>`\n\n```html\n<iframe src="javascript:alert(1)"></iframe>\n```')
    result = page.js(f"""(() => {{
        const el = document.createElement('div');
        document.body.append(el);
        window.rillChat.renderMarkdown(el, {json.dumps(hostile)});
        return {{text: el.textContent, tags: [...el.querySelectorAll('*')].map(e => e.tagName),
                 strong: el.querySelector('strong').textContent, code: el.querySelector('pre code').textContent}};
    }})()""")
    time.sleep(0.3)  # an injected onerror handler would have fired by now
    assert page.js("window.__pwned === undefined")
    assert set(result["tags"]) <= {"P", "BR", "STRONG", "CODE", "PRE"}, result["tags"]
    assert "<script>window.__pwned = 1</script>" in result["text"]
    assert '<img src=x onerror="window.__pwned = 2">' in result["text"]
    assert result["strong"] == "bold"
    assert result["code"] == '<iframe src="javascript:alert(1)"></iframe>'


def test_reasoning_is_folded_above_the_reply(page: Page) -> None:
    """A thinking model's reasoning (forced here with a regex the page's frames are given) shows in
    a closed fold above the reply, as text, and stays out of the conversation's history."""
    page.js("document.getElementById('new-chat').click()")
    set_field(page, "temperature", "0")
    set_field(page, "max_tokens", "80")
    regex = r"<think>[a-z]{1,8}( [a-z]{1,8}){2,5}\.</think>\n\n[A-Z][a-z]{1,8}( [a-z]{1,8}){1,4}\."
    page.js(f"""(() => {{
        const send = window.__send = WebSocket.prototype.send;
        WebSocket.prototype.send = function (data) {{
            const f = JSON.parse(data);
            if (f.type === 'chat') f.structured_outputs = {{regex: {json.dumps(regex)}}};
            return send.call(this, JSON.stringify(f));
        }};
    }})()""")
    try:
        send_message(page, "Think first, then tell me a fact about rivers.")
        page.wait_for(f"{LAST_REPLY}.dataset.state !== 'streaming'", 120, "the reply to finish")
    finally:
        page.js("WebSocket.prototype.send = window.__send")
    fold = page.js(f"(() => {{ const d = {LAST_REPLY}.querySelector('details.thinking');"
                   " return d && {open: d.open, text: d.querySelector('div').textContent}; })()")
    answer = page.js(f"{LAST_REPLY}.querySelector('.body').textContent")
    assert fold is not None and not fold["open"] and re.fullmatch(r"[a-z]+( [a-z]+)+\.", fold["text"]), fold
    assert re.fullmatch(r"[A-Z][a-z]*( [a-z]+)+\.", answer), answer
    assert page.js("window.rillChat.history.at(-1).content") == answer  # the reasoning is not sent back


def test_page_reconnects_after_the_socket_drops(page: Page, stack: ServiceStack) -> None:
    page.js("""(() => {
        const conn = document.getElementById('conn');
        window.__conn = [];
        new MutationObserver(() => window.__conn.push(conn.dataset.state))
            .observe(conn, {attributes: true, attributeFilter: ['data-state']});
    })()""")
    stack.restart("gateway")  # every open socket drops
    page.wait_for("window.__conn.includes('closed') && document.getElementById('conn').dataset.state === 'open'",
                  60, "the page to notice the drop and reconnect")
    set_field(page, "max_tokens", "8")
    before = page.js("document.querySelectorAll('.msg.assistant').length")
    send_message(page, "Say hi.")
    page.wait_for(f"document.querySelectorAll('.msg.assistant').length > {before} && "
                  f"{LAST_REPLY}.dataset.state === 'done'", 120, "a reply after reconnecting")
    assert page.js(f"{LAST_REPLY}.querySelector('.body').textContent.length") > 0
