"""`rill chat`: a terminal chat with a running Rill server over its WebSocket (/v1/ws).

Replies stream as they are generated. Ctrl-C during a reply cancels that reply (the server
frees its KV blocks at once) and returns to the prompt; at the prompt, Ctrl-D or /quit leaves.
The conversation is kept here and sent whole with every turn, so a dropped connection loses
nothing: the next turn reconnects.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

from rill.shared import envs

DEFAULT_URL = "ws://127.0.0.1:8000/v1/ws"
RECV_POLL_S = 0.1  # how often a streaming reply looks at Ctrl-C
CANCEL_WAIT_S = 5.0  # after a cancel, how long to wait for the server's confirmation
PROMPT_TICK_S = 0.1  # at the prompt, how often a Ctrl-C that readline has not seen yet is looked at
HELP = ("Enter sends · Ctrl-C stops a reply · /reset starts over · "
        "/set temperature|top_p|top_k|max_tokens|seed VALUE · /quit or Ctrl-D leaves")
SETTABLE = {"temperature": float, "top_p": float, "max_tokens": int, "top_k": int, "seed": int}


def ws_url(url: str) -> str:
    """Accept ws(s)://, http(s):// or host:port; a URL without a path gets /v1/ws."""
    if "://" not in url:
        url = f"ws://{url}"
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"not a WebSocket or HTTP URL: {url}")
    path = parts.path if parts.path not in ("", "/") else "/v1/ws"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def http_base(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(({"wss": "https"}.get(parts.scheme, "http"), parts.netloc, "", "", ""))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=envs.RILL_URL or DEFAULT_URL,
                   help=f"the server: ws://host:port/v1/ws or http://host:port (default {DEFAULT_URL}, or $RILL_URL)")
    p.add_argument("--api-key", default=envs.RILL_API_KEY,
                   help="the server's --api-key (default $RILL_API_KEY)")
    p.add_argument("--system", default=None, help="a system prompt for the conversation")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens in one reply")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-stats", action="store_true", help="do not print tokens, TTFT and tokens/s after replies")


@dataclass
class Reply:
    text: str
    finish_reason: str | None  # stop, length, abort; None when it failed
    usage: dict[str, int] = field(default_factory=dict)
    ttft_s: float | None = None
    decode_s: float | None = None  # from the first token to the end
    error: str | None = None


@dataclass
class _Turn:
    """One reply as it streams in."""

    rid: str
    t0: float
    parts: list[str] = field(default_factory=list)
    t_first: float | None = None
    t_last: float = 0.0
    cancelled_at: float | None = None  # Ctrl-C: print nothing more, wait for the server's done

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ChatSession:
    """One conversation over one (re)connecting socket."""

    def __init__(self, url: str, params: dict[str, Any], system: str | None = None,
                 out: TextIO = sys.stdout, api_key: str | None = None) -> None:
        self.url = ws_url(url)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.params = params
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.out = out
        self.ws: Any = None
        self.streaming = False
        self.interrupt = threading.Event()  # set by Ctrl-C while a reply streams
        self._seq = 0

    # -- connection ------------------------------------------------------------------------

    def connect(self) -> None:
        from websockets.sync.client import connect

        self.close()
        # The sync client reads frames on a thread of its own. A Ctrl-C (or the prompt's timer
        # tick) that the kernel delivers to that thread does not interrupt readline's select() in
        # the main thread, which only looks at Python's signal flags when select fails with
        # EINTR, so that Ctrl-C at the prompt would go unnoticed. Threads inherit their creator's
        # signal mask: the connection is opened with both blocked, and the main thread alone
        # receives them.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGALRM})
        try:
            # __enter__ gives the connection on every websockets version (17.1 warns without it).
            self.ws = connect(self.url, open_timeout=10, max_size=None, close_timeout=2,
                              additional_headers=self.headers).__enter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def close(self) -> None:
        if self.ws is not None:
            try:
                self.ws.close()
            except Exception:  # already gone
                pass
            self.ws = None

    def _send(self, frame: dict[str, Any]) -> None:
        from websockets.exceptions import ConnectionClosed

        if self.ws is None:
            self.connect()
        try:
            self.ws.send(json.dumps(frame))
        except ConnectionClosed:  # the server restarted since the last turn: one fresh try
            self.connect()
            self.ws.send(json.dumps(frame))

    # -- one turn --------------------------------------------------------------------------

    def ask(self, text: str) -> Reply:
        """Send one user turn and stream the reply to `out`; Ctrl-C (interrupt) cancels it."""
        from websockets.exceptions import ConnectionClosed

        self._seq += 1
        messages = [*self.history, {"role": "user", "content": text}]
        self.interrupt.clear()
        turn = _Turn(rid=f"t{self._seq}", t0=time.perf_counter())
        self.streaming = True  # from here on Ctrl-C cancels instead of raising
        try:
            self._send({"type": "chat", "id": turn.rid, "messages": messages, **self.params})
            reply = None
            while reply is None:
                reply = self._next(turn)
        except ConnectionClosed:
            self.ws = None
            reply = Reply(turn.text, None, error="connection lost (the next message reconnects)")
        finally:
            self.streaming = False
        if turn.t_first is not None:
            reply.ttft_s = turn.t_first - turn.t0
            reply.decode_s = turn.t_last - turn.t_first  # first to last token, as the page measures it
        if reply.error is None and reply.text:  # a stopped reply keeps what was said so far
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply.text}]
        return reply

    def _next(self, turn: _Turn) -> Reply | None:
        """Cancel on Ctrl-C, then take one frame of the streaming reply; the Reply once it ended."""
        if self.interrupt.is_set() and turn.cancelled_at is None:
            turn.cancelled_at = time.perf_counter()  # print nothing more; the server confirms with done
            self.ws.send(json.dumps({"type": "cancel", "id": turn.rid}))
        try:
            raw = self.ws.recv(timeout=RECV_POLL_S)
        except TimeoutError:
            if turn.cancelled_at is not None and time.perf_counter() - turn.cancelled_at > CANCEL_WAIT_S:
                self.close()  # a server that does not answer: drop the socket, the next turn reconnects
                return Reply(turn.text, "abort")
            return None
        try:
            frame = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(frame, dict) or frame.get("id") not in (turn.rid, None):
            return None
        kind = frame.get("type")
        if kind == "delta" and turn.cancelled_at is None:
            if turn.t_first is None:
                turn.t_first = time.perf_counter()
            reasoning = frame.get("reasoning")
            if isinstance(reasoning, str):  # a thinking model's (--reasoning-parser): dim, not in the history
                self.out.write(f"\x1b[2m{reasoning}\x1b[0m" if self.out.isatty() else reasoning)
            turn.parts.append(str(frame.get("text", "")))
            self.out.write(turn.parts[-1])
            self.out.flush()
            turn.t_last = time.perf_counter()
        elif kind == "done":
            reason = "abort" if turn.cancelled_at is not None else frame.get("finish_reason")
            return Reply(turn.text, reason, frame.get("usage") or {})
        elif kind == "error":
            err = frame.get("error") or {}
            return Reply(turn.text, None, error=str(err.get("message", err)))
        return None

    def reset(self) -> None:
        self.history = [m for m in self.history if m["role"] == "system"]


def stats_line(reply: Reply) -> str:
    parts: list[str] = []
    n = reply.usage.get("completion_tokens")
    if n is not None:
        parts.append(f"{n} token{'' if n == 1 else 's'}")
    if reply.ttft_s is not None:
        parts.append(f"TTFT {reply.ttft_s * 1000:.0f} ms")
    if n and n > 1 and reply.decode_s:
        parts.append(f"{(n - 1) / reply.decode_s:.1f} tok/s")
    if reply.finish_reason == "abort":
        parts.append("stopped")
    elif reply.finish_reason == "length":
        parts.append("max tokens reached")
    if reply.error:
        parts.append(f"error: {reply.error}")
    return "[" + " · ".join(parts) + "]"


def _model_name(url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{http_base(url)}/v1/models", timeout=3) as resp:
            return str(json.load(resp)["data"][0]["id"])
    except Exception:  # only cosmetic
        return None


def _params(ns: argparse.Namespace) -> dict[str, Any]:
    raw = {"temperature": ns.temperature, "top_p": ns.top_p, "top_k": ns.top_k, "max_tokens": ns.max_tokens,
           "seed": ns.seed}
    return {k: v for k, v in raw.items() if v is not None}


def _command(session: ChatSession, line: str, out: TextIO) -> bool:
    """Handle a /command; False means leave."""
    cmd, *args = line.split()
    if cmd in ("/quit", "/exit"):
        return False
    if cmd == "/reset":
        session.reset()
        out.write("(new conversation)\n")
    elif cmd == "/set" and len(args) == 2 and args[0] in SETTABLE:
        try:
            session.params[args[0]] = SETTABLE[args[0]](args[1])
            out.write(f"({args[0]} = {session.params[args[0]]})\n")
        except ValueError:
            out.write(f"(not a valid {args[0]}: {args[1]})\n")
    else:
        out.write(f"({HELP})\n")
    return True


def read_line(prompt: str) -> str:
    """input() whose Ctrl-C is never lost. readline looks at Python's signal flags only when its
    select() fails with EINTR; a Ctrl-C that lands after the prompt is printed but before select
    starts waiting sets the flag and then waits for the next key (a test typing Ctrl-C as soon as
    it read the prompt lost one now and then in CI). A timer signal every PROMPT_TICK_S interrupts
    the wait, so a pending Ctrl-C is acted on within that time."""
    signal.setitimer(signal.ITIMER_REAL, PROMPT_TICK_S, PROMPT_TICK_S)
    try:
        return input(prompt)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run(ns: argparse.Namespace) -> int:
    out = sys.stdout
    dim = (lambda s: f"\x1b[2m{s}\x1b[0m") if out.isatty() and not envs.NO_COLOR else (lambda s: s)
    try:
        session = ChatSession(ns.url, _params(ns), ns.system, out, ns.api_key)
        session.connect()
    except Exception as exc:
        print(f"rill chat: cannot connect to {ns.url}: {exc}", file=sys.stderr)
        return 1
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass

    def on_sigint(signum: int, frame: Any) -> None:
        if session.streaming:
            session.interrupt.set()  # cancel the reply, keep the program
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGALRM, lambda signum, frame: None)  # read_line's tick: only wakes select()
    model = _model_name(session.url)
    out.write(f"rill chat · {model or 'model'} at {session.url}\n{dim(HELP)}\n")
    try:
        while True:
            try:
                line = read_line("\nyou> ").strip()
            except KeyboardInterrupt:
                out.write("\n(Ctrl-D or /quit leaves)\n")
                continue
            except EOFError:
                out.write("\n")
                return 0
            if not line:
                continue
            if line.startswith("/"):
                if not _command(session, line, out):
                    return 0
                continue
            try:
                reply = session.ask(line)
            except Exception as exc:  # could not (re)connect: say so and let the user retry
                session.close()
                out.write(f"[error: cannot reach {session.url}: {exc}]\n")
                continue
            out.write("\n")
            if not ns.no_stats or reply.error:
                out.write(dim(stats_line(reply)) + "\n")
            out.flush()
    finally:
        session.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rill chat", description="Chat with a Rill server in the terminal")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
