// The chat page: models from /v1/models (followed while the page is open), answers streamed from
// /v1/chat/completions (server-sent events over fetch, so the invoke token can travel in a header), rendered as
// Markdown by markdown-it with raw HTML off and sanitised by DOMPurify. Nothing a model writes is ever run: it
// reaches the DOM only through DOMPurify or textContent, and the page's Content-Security-Policy allows no inline
// script besides.
//
// An answer renders as it streams without re-rendering what is already on the page (`StreamedMarkdown`): the
// Markdown blocks that are complete are rendered once and kept, only the last one is rendered again (at most once
// per frame, and at most OPEN_BLOCK_LIMIT characters of it), and a fenced code block grows as text. So a 200 KB
// answer costs each frame about what its newest block costs, not what the whole answer does.
"use strict";

(() => {
  const TOKEN_KEY = "qiip.chat.token"; // sessionStorage: this tab only
  const SYSTEM_KEY = "qiip.chat.system"; // localStorage
  const MODEL_KEY = "qiip.chat.model"; // localStorage
  const MAX_TOKENS_KEY = "qiip.chat.max_tokens"; // localStorage
  const MODELS_POLL_MS = 5000; // how often the model list is read again while the page is shown
  const OPEN_BLOCK_LIMIT = 4096; // characters of an unfinished block re-rendered per frame; past it, a line ends it
  const FRAME_BUDGET_MS = 6; // time a frame spends on finished blocks at most (one batch at least); the rest waits
  const BATCH_CHARS = 4096; // finished Markdown rendered in one go (one markdown-it and DOMPurify pass)

  const $ = (id) => document.getElementById(id);
  const markdown = window.markdownit({ html: false, linkify: true });

  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });

  /** Markdown to sanitised nodes, ready to insert; raw HTML in the text stays text (markdown-it `html: false`). */
  function renderMarkdown(text) {
    return DOMPurify.sanitize(markdown.render(text), {
      FORBID_TAGS: ["style"],
      FORBID_ATTR: ["style"],
      RETURN_DOM_FRAGMENT: true,
    });
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})(.*)$/;

  /** A streamed Markdown answer, rendered into `root` as it grows: each complete block once, the open one again
   * at most once per frame. Blocks end at a blank line outside a fenced code block, around a fenced code block,
   * and (for a block that never ends) at a line past OPEN_BLOCK_LIMIT characters. */
  class StreamedMarkdown {
    constructor(root) {
      this.root = root;
      this.text = "";
      this.scanned = 0; // the text before this index is split into lines
      this.blockStart = 0; // where the open (unfinished) block starts
      this.finished = []; // {start, end, fence, closed} of complete blocks not rendered yet
      this.fence = null; // {marker, info, code, shown} while inside a fenced code block
      this.open = document.createElement("div");
      this.open.className = "open";
      this.openShown = -1; // the text's length when the open block was last rendered
      this.root.append(this.open);
      this.frame = 0;
    }

    append(piece) {
      this.text += piece;
      if (!this.frame) this.frame = requestAnimationFrame(() => this.render());
    }

    /** Split the new complete lines into blocks. */
    scan() {
      const text = this.text;
      let lineEnd;
      while ((lineEnd = text.indexOf("\n", this.scanned)) >= 0) {
        const lineStart = this.scanned;
        const line = text.slice(lineStart, lineEnd);
        this.scanned = lineEnd + 1;
        const match = FENCE.exec(line);
        if (this.fence) {
          const marker = this.fence.marker;
          if (match && match[1][0] === marker[0] && match[1].length >= marker.length && !match[2].trim()) {
            this.finished.push({ start: this.blockStart, end: lineStart, fence: this.fence });
            this.fence = null;
            this.blockStart = this.scanned;
          }
        } else if (match) {
          this.endBlock(lineStart);
          this.fence = { marker: match[1], info: match[2].trim().split(/\s/)[0], code: null, shown: 0 };
        } else if (!line.trim()) {
          this.endBlock(this.scanned);
        } else if (lineStart - this.blockStart > OPEN_BLOCK_LIMIT) {
          this.endBlock(lineStart);
        }
      }
    }

    endBlock(end) {
      if (this.text.slice(this.blockStart, end).trim()) this.finished.push({ start: this.blockStart, end, fence: null });
      this.blockStart = end;
    }

    /** One frame's work: the blocks that finished (within a budget; the rest next frame), then the open block. */
    /** One frame's work: the blocks that finished (for FRAME_BUDGET_MS; the rest next frame), then the open one. */
    render() {
      this.frame = 0;
      this.scan();
      const started = performance.now();
      do this.placeBatch();
      while (this.finished.length && performance.now() - started < FRAME_BUDGET_MS);
      if (this.finished.length) {
        this.frame = requestAnimationFrame(() => this.render());
        return;
      }
      this.renderOpen();
    }

    /** The next finished code block, or the next finished Markdown blocks up to BATCH_CHARS in one pass, rendered
     * before the open block. */
    placeBatch() {
      const first = this.finished[0];
      if (!first) return;
      if (first.fence) {
        this.finished.shift();
        const code = this.grow(first.fence, first.start, first.end);
        first.fence.code = null;
        this.root.insertBefore(code.parentElement, this.open);
        return;
      }
      let end = first.end;
      this.finished.shift();
      while (this.finished.length && !this.finished[0].fence && this.finished[0].end - first.start <= BATCH_CHARS) {
        end = this.finished.shift().end;
      }
      this.root.insertBefore(renderMarkdown(this.text.slice(first.start, end)), this.open);
    }

    /** The `<pre><code>` of a fenced block (as markdown-it renders one), its text from after the opening line to
     * `end` appended as text (never parsed as HTML). */
    grow(fence, start, end) {
      if (!fence.code) {
        const pre = document.createElement("pre");
        fence.code = document.createElement("code");
        if (fence.info) fence.code.className = `language-${fence.info.replace(/[^\w+#.-]/g, "")}`;
        pre.append(fence.code);
        fence.shown = 0;
      }
      const first = this.text.indexOf("\n", start) + 1;
      const body = first > 0 && end > first ? this.text.slice(first, end) : "";
      if (body.length > fence.shown) {
        fence.code.append(body.slice(fence.shown));
        fence.shown = body.length;
      }
      return fence.code;
    }

    renderOpen() {
      if (this.fence) {
        // An open code block grows in place by its complete lines (the last one may become its closing fence).
        const code = this.grow(this.fence, this.blockStart, this.scanned);
        if (code.parentElement.parentElement !== this.open) this.open.replaceChildren(code.parentElement);
        return;
      }
      const end = this.text.length;
      if (end === this.openShown) return;
      this.openShown = end;
      const text = this.text.slice(this.blockStart, end);
      this.open.replaceChildren(...(text.trim() ? [renderMarkdown(text)] : []));
    }

    /** The answer ended (or stopped): render what is left, all of it, now. */
    finish() {
      if (this.frame) cancelAnimationFrame(this.frame);
      this.frame = 0;
      this.scan();
      if (this.fence) {
        this.finished.push({ start: this.blockStart, end: this.text.length, fence: this.fence });
        this.fence = null;
        this.blockStart = this.text.length;
      }
      while (this.finished.length) this.placeBatch();
      const rest = this.text.slice(this.blockStart);
      this.open.remove();
      if (rest.trim()) this.root.append(renderMarkdown(rest));
    }
  }

  /** The turns so far: {user, answer, failed, stopped, view}. A failed or stopped turn is left out of later
   * requests (as in the console's chat): a strict template would refuse two user messages in a row. */
  const turns = [];
  let controller = null;

  function authHeaders() {
    const token = sessionStorage.getItem(TOKEN_KEY);
    return token ? { Authorization: `Bearer ${token}` } : {};
  }

  function notice(text) {
    const element = $("notice");
    element.textContent = text || "";
    element.hidden = !text;
  }

  /** The message of an OpenAI error answer, else its status line. */
  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return String(body.error.message);
    } catch (_) {
      // not JSON: fall through
    }
    return `HTTP ${response.status} ${response.statusText}`.trim();
  }

  function askForToken(reason) {
    $("token-reason").textContent = reason || "This gateway requires an invoke token.";
    $("token-form").hidden = false;
    $("token").focus();
    setReady(false);
  }

  function setReady(ready) {
    $("model").disabled = !ready;
    $("prompt").disabled = !ready;
    $("send").disabled = !ready || controller !== null || !$("model").value;
  }

  /** Read the model list. The first time (and after a token is given) an answer that is not a list says why;
   * a later read (`follow`, every MODELS_POLL_MS) only updates the list: a model a healthy node starts serving
   * joins it, one no node serves any more leaves it, and when that was the one chosen the choice is cleared (the
   * next message never goes to another model behind the reader's back). */
  async function loadModels({ follow = false } = {}) {
    let response;
    try {
      response = await fetch("v1/models", { headers: authHeaders(), cache: "no-store" });
    } catch (err) {
      if (!follow) notice(`The gateway could not be reached: ${err.message}`);
      return;
    }
    if (response.status === 401) {
      if (!follow || $("token-form").hidden) askForToken(await errorMessage(response));
      return;
    }
    if (!response.ok) {
      if (!follow) notice(`The model list could not be read: ${await errorMessage(response)}`);
      return;
    }
    const body = await response.json();
    const ids = body.data.map((model) => model.id);
    const select = $("model");
    const shown = [...select.options].map((option) => option.value);
    const chosen = select.value;
    if (!follow || ids.join("\n") !== shown.join("\n")) {
      select.replaceChildren(...ids.map((id) => new Option(id, id)));
      if (follow) {
        if (chosen && ids.includes(chosen)) select.value = chosen;
        else if (chosen) {
          select.selectedIndex = -1;
          notice(`${chosen} is no longer served; choose a model.`);
        } else select.selectedIndex = -1;
      } else {
        const remembered = localStorage.getItem(MODEL_KEY);
        if (remembered && ids.includes(remembered)) select.value = remembered;
      }
    }
    if (follow && !$("prompt").disabled) {
      setReady(true);
      return;
    }
    $("token-form").hidden = true;
    $("change-token").hidden = !sessionStorage.getItem(TOKEN_KEY);
    if (ids.length === 0) {
      notice("No model is served by a healthy node right now.");
      setReady(false);
      return;
    }
    notice("");
    setReady(true);
  }

  function followModels() {
    setTimeout(async () => {
      if (document.visibilityState === "visible" && $("token-form").hidden) await loadModels({ follow: true });
      followModels();
    }, MODELS_POLL_MS);
  }

  function turnView(turn) {
    const view = document.createElement("article");
    view.className = "turn";
    const user = document.createElement("div");
    user.className = "message user";
    user.textContent = turn.user;
    const answer = document.createElement("div");
    answer.className = "message assistant";
    const body = document.createElement("div");
    body.className = "markdown";
    const status = document.createElement("p");
    status.className = "status";
    answer.append(body, status);
    view.append(user, answer);
    $("messages").append(view);
    return { root: view, body, status };
  }

  /** The request's messages: the system prompt, the turns that ended well, then the new one. */
  function requestMessages(current) {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const turn of turns) {
      if (turn === current || turn.failed || turn.stopped) continue;
      messages.push({ role: "user", content: turn.user });
      if (turn.answer) messages.push({ role: "assistant", content: turn.answer });
    }
    messages.push({ role: "user", content: current.user });
    return messages;
  }

  /** `max_tokens` (the OpenAI field) from the "Longest answer" box; nothing when it is empty. */
  function maxTokens() {
    const value = Number.parseInt($("max-tokens").value, 10);
    return Number.isInteger(value) && value > 0 ? { max_tokens: value } : {};
  }

  class TurnError extends Error {
    constructor(message, status) {
      super(message);
      this.status = status;
    }
  }

  /** Server-sent events out of a byte stream: yields each event's data (its `data:` lines joined). */
  async function* sseData(stream) {
    const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer = (buffer + value).replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const lines = buffer.slice(0, end).split("\n");
          buffer = buffer.slice(end + 2);
          const data = lines.filter((line) => line.startsWith("data:")).map((line) => line.slice(5).replace(/^ /, ""));
          if (data.length) yield data.join("\n");
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function showStats(turn, stats) {
    const parts = [];
    if (stats.firstAt !== null) parts.push(`TTFT ${Math.round(stats.firstAt - stats.startedAt)} ms`);
    const tokens = stats.usageTokens ?? stats.chunks;
    const seconds = (stats.endedAt - (stats.firstAt ?? stats.endedAt)) / 1000;
    if (tokens > 1 && seconds > 0) parts.push(`${(tokens / seconds).toFixed(1)} tokens/s`);
    if (tokens > 0) parts.push(tokens === 1 ? "1 token" : `${tokens} tokens`);
    const line = document.createElement("span");
    line.className = "stats";
    line.textContent = parts.join(" · ");
    turn.view.status.prepend(line);
  }

  function showFailure(turn, message) {
    turn.view.root.classList.add("failed");
    const error = document.createElement("span");
    error.className = "error";
    error.textContent = `${message} This turn is left out of the next request.`;
    turn.view.status.append(error);
    if (/system/i.test(message) && $("system").value.trim()) {
      const hint = document.createElement("span");
      hint.className = "hint";
      hint.textContent = "This model's chat template may not accept a system prompt. ";
      const clear = document.createElement("button");
      clear.type = "button";
      clear.className = "link";
      clear.textContent = "Clear the system prompt";
      clear.addEventListener("click", () => {
        $("system").value = "";
        localStorage.removeItem(SYSTEM_KEY);
        hint.remove();
      });
      hint.append(clear);
      turn.view.status.append(hint);
    }
  }

  async function send(text) {
    const turn = { user: text, answer: "", failed: false, stopped: false };
    const messages = requestMessages(turn);
    turns.push(turn);
    turn.view = turnView(turn);
    turn.view.root.scrollIntoView({ block: "end" });
    controller = new AbortController();
    $("stop").disabled = false;
    setReady(true);
    turn.view.root.classList.add("streaming");

    const stats = { startedAt: performance.now(), firstAt: null, endedAt: 0, chunks: 0, usageTokens: null };
    const view = new StreamedMarkdown(turn.view.body);
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify({
          model: $("model").value,
          messages,
          ...maxTokens(),
          stream: true,
          stream_options: { include_usage: true },
        }),
        signal: controller.signal,
      });
      if (!response.ok) throw new TurnError(await errorMessage(response), response.status);
      let finished = false;
      for await (const data of sseData(response.body)) {
        if (data === "[DONE]") {
          finished = true;
          break;
        }
        let event;
        try {
          event = JSON.parse(data);
        } catch (_) {
          continue;
        }
        if (event.error) throw new TurnError(String(event.error.message || JSON.stringify(event.error)));
        if (event.usage && typeof event.usage.completion_tokens === "number") {
          stats.usageTokens = event.usage.completion_tokens;
        }
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (delta && typeof delta.content === "string" && delta.content) {
          stats.firstAt ??= performance.now();
          stats.chunks += 1;
          turn.answer += delta.content;
          view.append(delta.content);
        }
      }
      if (!finished) throw new TurnError("The connection ended before the answer was complete.");
    } catch (err) {
      if (err.name === "AbortError") {
        turn.stopped = true;
        turn.view.root.classList.add("stopped");
        const note = document.createElement("span");
        note.className = "note";
        note.textContent = "Stopped; left out of the next request.";
        turn.view.status.append(note);
      } else {
        turn.failed = true;
        const message = err instanceof TurnError ? err.message : `The connection failed: ${err.message}`;
        showFailure(turn, message);
        if (err.status === 401) askForToken(message);
      }
    } finally {
      stats.endedAt = performance.now();
      view.finish();
      showStats(turn, stats);
      turn.view.root.classList.remove("streaming");
      turn.view.root.classList.add("done");
      controller = null;
      $("stop").disabled = true;
      setReady(!$("prompt").disabled);
    }
  }

  function start() {
    const system = $("system");
    system.value = localStorage.getItem(SYSTEM_KEY) || "";
    if (system.value) $("system-box").open = true;
    system.addEventListener("input", () => {
      if (system.value) localStorage.setItem(SYSTEM_KEY, system.value);
      else localStorage.removeItem(SYSTEM_KEY);
    });
    const longest = $("max-tokens");
    longest.value = localStorage.getItem(MAX_TOKENS_KEY) ?? longest.value;
    longest.addEventListener("input", () => localStorage.setItem(MAX_TOKENS_KEY, longest.value));
    $("model").addEventListener("change", () => {
      localStorage.setItem(MODEL_KEY, $("model").value);
      notice("");
      setReady(!$("prompt").disabled);
    });
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
      $("token").value = "";
      loadModels();
    });
    $("change-token").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      askForToken("Enter another invoke token.");
    });
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || controller !== null || $("prompt").disabled || !$("model").value) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => controller && controller.abort());
    // Esc stops the answer being written, wherever the focus is.
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && controller !== null && !event.isComposing) {
        event.preventDefault();
        controller.abort();
      }
    });
    loadModels();
    followModels();
  }

  // For use-with.js: the token header, the selected model, the notice line.
  window.qiipChat = { authHeaders, errorMessage, notice, selectedModel: () => $("model").value };
  start();
})();
