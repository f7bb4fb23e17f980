"""`rill chat` in a pseudo-terminal against a running stack: a streamed reply, Ctrl-C cancels the
reply (not the program), the conversation carries over, Ctrl-D leaves."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from service_stack import ServiceStack, fresh_stack, rill_executable

from rill.services.clients.chat_client import ws_url
from rill.shared.broker import free_port
from rill.shared.bus import FIELD
from rill.shared.schema import generate_decoder

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")
STATS = re.compile(r"\[(\d+) tokens?[^\]\n]*\]")
PROMPT = "you> "
# Make the pty the child's controlling terminal, so Ctrl-C typed there is a SIGINT to it. NOFLSH:
# by default a terminal discards output still in transit when Ctrl-C is typed, and the program
# can answer the signal before that discard happens, which would lose its reply; with NOFLSH the
# test sees everything the program printed.
CTTY = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); t = termios.tcgetattr(0); "
        "t[3] |= termios.NOFLSH; termios.tcsetattr(0, termios.TCSANOW, t); os.execv(sys.argv[1], sys.argv[1:])")


class Terminal:
    """A program running on a pseudo-terminal; reads what it prints, types into it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-c", CTTY, *argv], stdin=slave, stdout=slave, stderr=slave,
                                     env=env, start_new_session=True)
        os.close(slave)
        self.fd = master
        self.text = ""  # everything printed so far, ANSI codes removed, \r\n as \n
        self.reads: list[tuple[int, float]] = []  # (length of text after each read, time)

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # the program exited and closed the terminal
            return False
        self.text += ANSI.sub("", data.decode(errors="replace")).replace("\r\n", "\n").replace("\r", "")
        self.reads.append((len(self.text), time.monotonic()))
        return bool(data)

    def expect(self, pattern: str | re.Pattern[str], start: int, timeout: float = 60.0) -> re.Match[str]:
        """Wait until `pattern` appears in the output after position `start`."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.text, start)
            if m:
                return m
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {rx.pattern!r}; output so far:\n{self.text[start:]}"
            if not self._read(min(left, 0.5)):
                assert self.proc.poll() is None or self._read(0), \
                    f"rill chat exited ({self.proc.returncode}); output:\n{self.text}"

    def type(self, data: str) -> int:
        """Type `data`; returns the output position before it, to look for what follows."""
        while self._read(0):
            pass
        mark = len(self.text)
        os.write(self.fd, data.encode())
        return mark

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.fd)


@pytest.fixture(scope="module")
def stack(redis_url: str, smollm2_dir: str) -> Iterator[ServiceStack]:
    with fresh_stack(redis_url, smollm2_dir, "cli") as st:
        yield st


def http_chat(stack: ServiceStack, content: str, max_tokens: int) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "temperature": 0,
                       "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"{stack.base_url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)["choices"][0]["message"]["content"]


def test_rill_chat_in_a_terminal(stack: ServiceStack) -> None:
    env = dict(os.environ, TERM="dumb", NO_COLOR="1", PYTHONUNBUFFERED="1")
    term = Terminal([*rill_executable(), "chat", "--url", stack.base_url, "--temperature", "0",
                     "--max-tokens", "10"], env)
    try:
        term.expect(PROMPT, 0, timeout=60)

        # 1. A streamed reply, the same text the server gives over HTTP.
        question = "Name three colours of the rainbow."
        mark = term.type(question + "\r")
        echoed = term.expect(re.escape(question) + "\n", mark).end()
        stats = term.expect(STATS, echoed, timeout=120)
        term.expect(PROMPT, stats.end())
        reply = term.text[echoed:stats.start()].removesuffix("\n")
        assert reply == http_chat(stack, question, 10)
        assert stats.group(1) == "10" and "TTFT" in stats.group(0) and "tok/s" in stats.group(0)
        pieces = [n for n, _ in term.reads if echoed < n <= stats.start()]
        assert len(pieces) >= 2, f"the reply arrived in one piece: {reply!r}"

        # 2. Ctrl-C stops a long reply; the program carries on at the prompt.
        mark = term.type("/set max_tokens 400\r")
        # Type only once the prompt is back: typed earlier, the terminal itself echoes the line
        # and readline shows it again, so the echo below would be found twice.
        term.expect(PROMPT, term.expect(r"\(max_tokens = 400\)", mark).end())
        story = "Write a long story about a dragon who learns to bake bread."
        mark = term.type(story + "\r")
        echoed = term.expect(re.escape(story) + "\n", mark).end()
        term.expect(r"\S{2,}[\s\S]{30}", echoed, timeout=120)  # some of the story has arrived
        term.type("\x03")
        stats = term.expect(STATS, echoed, timeout=30)
        assert "stopped" in stats.group(0)
        assert int(stats.group(1)) < 400
        term.expect(PROMPT, stats.end())
        assert term.proc.poll() is None
        st = stack.wait_idle()
        assert st.num_running == 0 and st.num_waiting == 0 and st.aborted_requests >= 1
        # What was on screen before the echoed ^C, which the terminal writes into the reply.
        shown = term.text[echoed:stats.start()].split("^C")[0]

        # 3. The next turn carries the whole conversation, the stopped reply included.
        mark = term.type("/set max_tokens 4\r")
        term.expect(PROMPT, term.expect(r"\(max_tokens = 4\)", mark).end())
        mark = term.type("Thanks!\r")
        term.expect(PROMPT, term.expect(STATS, mark, timeout=120).end())
        last = generate_decoder.decode(stack.sent_requests()[-1][1][FIELD])
        turns = [(m.role, m.content) for m in last.messages or []]
        assert turns[:3] == [("user", question), ("assistant", reply), ("user", story)]
        assert turns[3][0] == "assistant" and len(shown.strip()) >= 30 and turns[3][1].startswith(shown)
        assert turns[4:] == [("user", "Thanks!")]

        # 4. Ctrl-C at the prompt does not quit either; Ctrl-D does, cleanly.
        mark = term.type("\x03")
        term.expect(r"Ctrl-D or /quit leaves", mark)
        term.expect(PROMPT, mark)
        assert term.proc.poll() is None
        term.type("\x04")
        assert term.proc.wait(15) == 0
    finally:
        term.close()


# Ctrl-C taken by another thread while the main thread waits at the prompt: Python only sets a
# flag, and readline's select() is not interrupted (the same as a Ctrl-C that lands just before
# select starts waiting). read_line must still raise KeyboardInterrupt.
PENDING_CTRL_C = """
import signal, sys, threading, time
from rill.services.clients.chat_client import read_line
signal.signal(signal.SIGINT, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt()))
signal.signal(signal.SIGALRM, lambda signum, frame: None)
def ctrl_c_elsewhere():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
threading.Thread(target=ctrl_c_elsewhere).start()
t0 = time.monotonic()
try:
    read_line("ready> ")
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - t0:.2f} s")
"""


def test_a_pending_ctrl_c_is_not_lost_at_the_prompt() -> None:
    term = Terminal([sys.executable, "-c", PENDING_CTRL_C], dict(os.environ, TERM="dumb"))
    try:
        term.expect("ready> ", 0, timeout=30)
        m = term.expect(r"interrupted after ([0-9.]+) s", 0, timeout=10)
        assert float(m.group(1)) < 2.0
        assert term.proc.wait(10) == 0
    finally:
        term.close()


def test_rill_chat_reports_an_unreachable_server() -> None:
    out = subprocess.run([*rill_executable(), "chat", "--url", f"127.0.0.1:{free_port()}"], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 1
    assert "cannot connect" in out.stderr


@pytest.mark.parametrize("given, expected", [
    ("127.0.0.1:8000", "ws://127.0.0.1:8000/v1/ws"), ("http://h:8000", "ws://h:8000/v1/ws"),
    ("http://h:8000/", "ws://h:8000/v1/ws"), ("https://h/proxy/v1/ws", "wss://h/proxy/v1/ws"),
    ("ws://h:1/v1/ws?x=1", "ws://h:1/v1/ws?x=1")])
def test_url_forms(given: str, expected: str) -> None:
    assert ws_url(given) == expected


def test_url_rejects_other_schemes() -> None:
    with pytest.raises(ValueError):
        ws_url("ftp://h:21")
