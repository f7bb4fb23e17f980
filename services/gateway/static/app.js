// Rill's chat page: a multi-turn chat over the gateway's /v1/ws protocol. Plain script, no build step.
//
// Safety: model output is untrusted. It only ever reaches the page as text nodes (textContent /
// append(string)); the light markdown (``` code blocks, `inline code`, **bold**) builds elements
// with createElement. Nothing here assigns innerHTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const els = {
    log: $("log"), empty: $("empty"), form: $("form"), input: $("input"), send: $("send"), stop: $("stop"),
    conn: $("conn"), connText: $("conn-text"), model: $("model"), newChat: $("new-chat"),
    temperature: $("temperature"), topP: $("top_p"), maxTokens: $("max_tokens"), system: $("system"),
  };
  const SETTINGS_KEY = "rill.chat.settings";
  // A server started with --api-key: open the page as /?api_key=KEY. Browsers cannot put headers
  // on a WebSocket, so the key travels as the socket URL's query (the gateway accepts it there).
  const API_KEY = new URLSearchParams(location.search).get("api_key") || "";
  const RETRY_MIN_MS = 500;
  const RETRY_MAX_MS = 8000;

  const history = []; // finished turns sent with every request: [{role, content}]
  let ws = null; // the current socket (null while reconnecting)
  let wsOpen = false;
  let retryMs = RETRY_MIN_MS;
  let reconnectTimer = null;
  let current = null; // the reply in flight
  let seq = 0;

  // ------------------------------------------------------------------ rendering (text nodes only)

  const INLINE = /(`[^`\n]+`|\*\*[^*\n]+\*\*)/g;
  const LANG = /^[\w+#.-]*$/;

  function renderInline(parent, line) {
    let last = 0;
    for (const m of line.matchAll(INLINE)) {
      if (m.index > last) parent.append(line.slice(last, m.index));
      const tok = m[0];
      const el = document.createElement(tok[0] === "`" ? "code" : "strong");
      el.textContent = tok[0] === "`" ? tok.slice(1, -1) : tok.slice(2, -2);
      parent.append(el);
      last = m.index + tok.length;
    }
    if (last < line.length) parent.append(line.slice(last));
  }

  function renderCode(frag, part) {
    // The fence's first line may name a language; an unclosed fence (still streaming) is code too.
    const nl = part.indexOf("\n");
    const head = nl < 0 ? part : part.slice(0, nl);
    let body = part;
    let lang = "";
    if (LANG.test(head.trim())) {
      lang = head.trim();
      body = nl < 0 ? "" : part.slice(nl + 1);
    }
    const pre = document.createElement("pre");
    const code = document.createElement("code");
    if (lang) pre.dataset.lang = lang;
    code.textContent = body.replace(/\n$/, "");
    pre.append(code);
    frag.append(pre);
  }

  function renderMarkdown(target, text) {
    const frag = document.createDocumentFragment();
    text.split("```").forEach((part, i) => {
      if (i % 2 === 1) {
        renderCode(frag, part);
        return;
      }
      for (const para of part.split(/\n{2,}/)) {
        const trimmed = para.replace(/^\n+|\n+$/g, "");
        if (!trimmed.trim()) continue;
        const p = document.createElement("p");
        trimmed.split("\n").forEach((line, j) => {
          if (j) p.append(document.createElement("br"));
          renderInline(p, line);
        });
        frag.append(p);
      }
    });
    target.replaceChildren(frag);
  }

  // ------------------------------------------------------------------ the conversation

  function nearBottom() {
    const el = document.scrollingElement;
    return el.scrollHeight - el.scrollTop - el.clientHeight < 80;
  }

  function scrollDown(force) {
    if (force || nearBottom()) window.scrollTo(0, document.scrollingElement.scrollHeight);
  }

  function addMessage(role) {
    els.empty.hidden = true;
    const msg = document.createElement("article");
    msg.className = `msg ${role}`;
    const body = document.createElement("div");
    body.className = "body";
    msg.append(body);
    let meta = null;
    if (role === "assistant") {
      meta = document.createElement("div");
      meta.className = "meta";
      msg.append(meta);
    }
    els.log.append(msg);
    return { msg, body, meta };
  }

  function readSettings() {
    const out = {};
    const t = parseFloat(els.temperature.value);
    if (Number.isFinite(t)) out.temperature = Math.min(2, Math.max(0, t));
    const p = parseFloat(els.topP.value);
    if (Number.isFinite(p) && p > 0) out.top_p = Math.min(1, p);
    const n = parseInt(els.maxTokens.value, 10);
    if (Number.isFinite(n) && n >= 1) out.max_tokens = n;
    return out;
  }

  function saveSettings() {
    try {
      localStorage.setItem(SETTINGS_KEY, JSON.stringify({
        temperature: els.temperature.value, top_p: els.topP.value, max_tokens: els.maxTokens.value,
        system: els.system.value,
      }));
    } catch (_) { /* storage may be disabled */ }
  }

  function loadSettings() {
    try {
      const s = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
      if (typeof s.temperature === "string") els.temperature.value = s.temperature;
      if (typeof s.top_p === "string") els.topP.value = s.top_p;
      if (typeof s.max_tokens === "string") els.maxTokens.value = s.max_tokens;
      if (typeof s.system === "string") els.system.value = s.system;
    } catch (_) { /* ignore a bad entry */ }
  }

  function updateButtons() {
    const busy = current !== null;
    els.send.hidden = busy;
    els.stop.hidden = !busy;
    els.stop.disabled = busy && current.stopping;
    els.send.disabled = !wsOpen;
  }

  function send() {
    const text = els.input.value.trim();
    if (!text || current !== null || !wsOpen) return;
    const messages = [];
    const system = els.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history, { role: "user", content: text });
    const id = `r${++seq}`;
    const frame = { type: "chat", id, messages, ...readSettings() };

    renderMarkdown(addMessage("user").body, text);
    const view = addMessage("assistant");
    view.msg.dataset.state = "streaming";
    view.meta.textContent = "waiting for the first token…";
    current = { id, userText: text, text: "", t0: performance.now(), tFirst: null, tLast: null, stopping: false,
      ...view };
    els.input.value = "";
    ws.send(JSON.stringify(frame));
    updateButtons();
    scrollDown(true);
  }

  function stop() {
    if (current === null || current.stopping) return;
    current.stopping = true; // ignore deltas already on the wire: the reply stops now
    if (wsOpen) ws.send(JSON.stringify({ type: "cancel", id: current.id }));
    else finish("abort", null);
    updateButtons();
  }

  function fmtMs(ms) {
    return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
  }

  function finish(reason, usage, error) {
    const c = current;
    current = null;
    renderMarkdown(c.body, c.text);
    const parts = [];
    const n = usage ? usage.completion_tokens : null;
    if (n !== null) parts.push(`${n} token${n === 1 ? "" : "s"}`);
    if (c.tFirst !== null) parts.push(`TTFT ${fmtMs(c.tFirst - c.t0)}`);
    // Decode rate: the tokens after the first over the time from the first delta to the last.
    if (n !== null && n > 1 && c.tFirst !== null && c.tLast > c.tFirst) {
      parts.push(`${((n - 1) / ((c.tLast - c.tFirst) / 1000)).toFixed(1)} tok/s`);
    }
    if (reason === "abort") parts.push("stopped");
    else if (reason === "length") parts.push("max tokens reached");
    if (error) parts.push(error);
    c.msg.dataset.state = reason === "abort" ? "stopped" : error ? "error" : "done";
    c.meta.textContent = parts.join(" · ");
    // A failed or empty reply leaves no turn behind; a stopped one keeps what was said so far.
    if (!error && c.text) history.push({ role: "user", content: c.userText }, { role: "assistant", content: c.text });
    updateButtons();
    scrollDown(false);
  }

  // A thinking model's reasoning (a server started with --reasoning-parser): folded above the reply.
  function showReasoning(c, text) {
    if (!c.thinking) {
      const details = document.createElement("details");
      details.className = "thinking";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      c.thinking = document.createElement("div");
      details.append(summary, c.thinking);
      c.msg.insertBefore(details, c.body);
    }
    c.thinking.textContent += text;
  }

  function onFrame(f) {
    if (current === null || f === null || typeof f !== "object") return;
    if (f.id === null && f.type === "error") { // the server could not read our frame
      finish("error", null, (f.error && f.error.message) || "error");
      return;
    }
    if (f.id !== current.id) return; // a reply we already finished
    if (f.type === "delta" && typeof f.text === "string") {
      if (current.stopping) return;
      const follow = nearBottom();
      if (current.tFirst === null) {
        current.tFirst = performance.now();
        current.meta.textContent = `TTFT ${fmtMs(current.tFirst - current.t0)} · streaming…`;
      }
      if (typeof f.reasoning === "string") showReasoning(current, f.reasoning);
      current.text += f.text;
      current.tLast = performance.now();
      if (f.text) renderMarkdown(current.body, current.text);
      if (follow) scrollDown(true);
    } else if (f.type === "done") {
      // Stopped just as it ended on its own: still a stopped reply to the person who pressed Stop.
      finish(current.stopping ? "abort" : f.finish_reason, f.usage || null);
    } else if (f.type === "error") {
      finish("error", null, (f.error && f.error.message) || "error");
    }
  }

  function newChat() {
    if (current !== null) stop();
    history.length = 0;
    els.log.querySelectorAll(".msg").forEach((m) => m.remove());
    els.empty.hidden = false;
    els.input.focus();
  }

  // ------------------------------------------------------------------ the socket, reconnecting

  function setConn(state, text) {
    els.conn.dataset.state = state;
    els.connText.textContent = text;
  }

  function loadModel() {
    fetch("/v1/models", API_KEY ? { headers: { Authorization: `Bearer ${API_KEY}` } } : {}).then((r) => r.json()).then((body) => {
      const m = body && body.data && body.data[0];
      if (m && typeof m.id === "string") els.model.textContent = m.id;
    }).catch(() => {});
  }

  function connect() {
    reconnectTimer = null;
    setConn("connecting", "connecting…");
    const query = API_KEY ? `?api_key=${encodeURIComponent(API_KEY)}` : "";
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/ws${query}`;
    let sock;
    try {
      sock = new WebSocket(url);
    } catch (_) {
      scheduleReconnect();
      return;
    }
    ws = sock;
    sock.onopen = () => {
      if (ws !== sock) return;
      wsOpen = true;
      retryMs = RETRY_MIN_MS;
      setConn("open", "connected");
      loadModel();
      updateButtons();
    };
    sock.onmessage = (ev) => {
      if (ws !== sock) return;
      let frame;
      try {
        frame = JSON.parse(ev.data);
      } catch (_) {
        return;
      }
      onFrame(frame);
    };
    sock.onclose = () => {
      if (ws !== sock) return;
      ws = null;
      wsOpen = false;
      // The gateway aborts a closed socket's requests, so the reply in flight is over.
      if (current !== null) finish("error", null, "connection lost; reply interrupted");
      scheduleReconnect();
    };
  }

  function scheduleReconnect() {
    if (reconnectTimer !== null) return;
    setConn("closed", `disconnected, retrying in ${(retryMs / 1000).toFixed(1)} s`);
    updateButtons();
    reconnectTimer = setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, RETRY_MAX_MS);
  }

  // ------------------------------------------------------------------ wiring

  els.form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  els.input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  els.stop.addEventListener("click", stop);
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") stop();
  });
  els.newChat.addEventListener("click", newChat);
  for (const el of [els.temperature, els.topP, els.maxTokens, els.system]) el.addEventListener("change", saveSettings);
  window.addEventListener("online", () => {
    if (ws === null && reconnectTimer !== null) {
      clearTimeout(reconnectTimer);
      connect();
    }
  });

  // A small handle for the console and for tests.
  window.rillChat = { renderMarkdown, history, get socket() { return ws; } };

  loadSettings();
  updateButtons();
  connect();
  els.input.focus();
})();
