// The chat page: models from /v1/models, answers streamed from /v1/chat/completions (server-sent events over
// fetch, so the invoke token can travel in a header), rendered as Markdown by markdown-it with raw HTML off and
// sanitised by DOMPurify. Nothing a model writes is ever run: it reaches the DOM only through DOMPurify or
// textContent, and the page's Content-Security-Policy allows no inline script besides.
"use strict";

(() => {
  const TOKEN_KEY = "qiip.chat.token"; // sessionStorage: this tab only
  const SYSTEM_KEY = "qiip.chat.system"; // localStorage
  const MODEL_KEY = "qiip.chat.model"; // localStorage
  const MAX_TOKENS_KEY = "qiip.chat.max_tokens"; // localStorage

  const $ = (id) => document.getElementById(id);
  const markdown = window.markdownit({ html: false, linkify: true });

  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });

  /** Markdown to sanitised HTML; raw HTML in the text stays text (markdown-it `html: false`). */
  function renderMarkdown(text) {
    return DOMPurify.sanitize(markdown.render(text), { FORBID_TAGS: ["style"], FORBID_ATTR: ["style"] });
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
    $("send").disabled = !ready || controller !== null;
  }

  async function loadModels() {
    let response;
    try {
      response = await fetch("v1/models", { headers: authHeaders(), cache: "no-store" });
    } catch (err) {
      notice(`The gateway could not be reached: ${err.message}`);
      return;
    }
    if (response.status === 401) {
      askForToken(await errorMessage(response));
      return;
    }
    if (!response.ok) {
      notice(`The model list could not be read: ${await errorMessage(response)}`);
      return;
    }
    const body = await response.json();
    const select = $("model");
    select.replaceChildren(...body.data.map((model) => new Option(model.id, model.id)));
    const remembered = localStorage.getItem(MODEL_KEY);
    if (remembered && body.data.some((model) => model.id === remembered)) select.value = remembered;
    $("token-form").hidden = true;
    $("change-token").hidden = !sessionStorage.getItem(TOKEN_KEY);
    if (body.data.length === 0) {
      notice("No model is served by a healthy node right now.");
      setReady(false);
      return;
    }
    notice("");
    setReady(true);
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
    let pending = false;
    const render = () => {
      pending = false;
      turn.view.body.innerHTML = renderMarkdown(turn.answer);
    };
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
          if (!pending) {
            pending = true;
            requestAnimationFrame(render);
          }
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
      render();
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
    $("model").addEventListener("change", () => localStorage.setItem(MODEL_KEY, $("model").value));
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
      if (!text || controller !== null || $("prompt").disabled) return;
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
    loadModels();
  }

  // For use-with.js: the token header, the selected model, the notice line.
  window.qiipChat = { authHeaders, errorMessage, notice, selectedModel: () => $("model").value };
  start();
})();
