// lmforge web chat: talks to this server's /v1/chat/completions with stream: true.
// Model output is only ever put into the page as text (textContent), never as HTML.
// The history sent with each message holds only finished exchanges: a reply that was stopped or failed is
// left out, with the message it answered (both stay on the page, greyed), so the model never sees a cut reply
// as a finished answer. A calculator call shows as <calculator>…</calculator><output>…</output>; sent back
// as it came, the server reads it as the call it was.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], controller: null };

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("span");
  body.className = "content";
  body.textContent = text;
  div.append(label, body);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/health");
    const info = await r.json();
    state.model = info.model;
    $("model").textContent = info.model + (info.chat ? "" : " (no chat format: this model cannot chat)");
    $("key-label").hidden = !info.auth;
    $("max-tokens").max = info.context_length;
    $("max-tokens").placeholder = "auto (≤ " + info.context_length + ")";
  } catch (e) {
    $("status").textContent = "cannot reach the server: " + e;
  }
}

// Parse server-sent events from a fetch body: yields the JSON of each `data:` line until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  state.history.push({ role: "user", content: text });
  const asked = addMessage("user", text);
  const out = addMessage("assistant", "");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  $("status").textContent = "generating…";
  let reply = "";
  let finish = null;
  // Tokens can arrive by the thousand per second: the reply is drawn at most once per frame, not per token.
  let frame = 0;
  const draw = () => {
    frame = 0;
    out.textContent = reply;
    out.parentElement.scrollIntoView({ block: "end" });
  };
  const flush = () => {  // the last tokens, now (a pending frame would redraw the same text)
    if (frame) cancelAnimationFrame(frame);
    draw();
  };
  try {
    const body = {
      model: state.model, messages: state.history, stream: true, temperature: Number($("temperature").value),
    };
    if ($("max-tokens").value) body.max_tokens = Number($("max-tokens").value);  // empty: what fits
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({ error: { message: r.statusText } }));
      throw new Error(err.error ? err.error.message : r.statusText);
    }
    for await (const chunk of events(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        if (!frame) frame = requestAnimationFrame(draw);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    flush();
    if (!finish) throw new Error("the reply ended without a finish reason");  // a cut connection
    $("status").textContent = finish === "length" ? "stopped at max tokens" : "";
  } catch (e) {
    flush();
    finish = null;
    if (e.name === "AbortError") {
      $("status").textContent = "stopped (this exchange is left out of the conversation)";
    } else {
      out.parentElement.classList.add("error");
      out.textContent = reply + (reply ? "\n" : "") + "error: " + e.message;
      $("status").textContent = "";
    }
  } finally {
    if (finish && reply) {
      state.history.push({ role: "assistant", content: reply });
    } else {  // stopped, failed or empty: neither message goes back to the model
      state.history.pop();
      for (const body of [asked, out]) {
        body.parentElement.classList.add("unsent");
        body.parentElement.title = "left out of the conversation sent to the model";
      }
    }
    state.controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value;
  if (!text.trim() || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("messages").replaceChildren();
  $("status").textContent = "";
  $("input").focus();
});

loadModel();
