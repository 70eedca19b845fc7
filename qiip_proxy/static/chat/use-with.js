// "Use with…": download a ready configuration file for a coding client and the selected model, from
// GET chat/config/{client}?model=M (behind the same invoke token as the rest of the page), saved through a Blob.
"use strict";

(() => {
  const CLIENTS = [
    ["opencode", "opencode"],
    ["pi", "pi"],
    ["omp", "omp"],
    ["continue", "Continue"],
  ];

  /** The file name of a Content-Disposition header (RFC 6266), without any directory part. */
  function fileName(disposition, fallback) {
    const match = /filename\*?=(?:UTF-8'')?"?([^";]+)"?/i.exec(disposition || "");
    const name = match ? decodeURIComponent(match[1]).split(/[\\/]/).pop() : "";
    return name || fallback;
  }

  async function download(client) {
    const chat = window.qiipChat;
    const model = chat.selectedModel();
    if (!model) return;
    const url = `chat/config/${encodeURIComponent(client)}?model=${encodeURIComponent(model)}`;
    let response;
    try {
      response = await fetch(url, { headers: chat.authHeaders(), cache: "no-store" });
    } catch (err) {
      chat.notice(`The ${client} configuration could not be fetched: ${err.message}`);
      return;
    }
    if (!response.ok) {
      chat.notice(`The ${client} configuration could not be made: ${await chat.errorMessage(response)}`);
      return;
    }
    const href = URL.createObjectURL(await response.blob());
    const link = document.createElement("a");
    link.href = href;
    link.download = fileName(response.headers.get("Content-Disposition"), `${client}-config`);
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(href), 60_000);
  }

  const menu = document.getElementById("use-with-menu");
  for (const [client, label] of CLIENTS) {
    const item = document.createElement("button");
    item.type = "button";
    item.setAttribute("role", "menuitem");
    item.textContent = label;
    item.addEventListener("click", () => {
      document.getElementById("use-with").open = false;
      download(client);
    });
    menu.append(item);
  }
})();
