// ktransformers chat page: conversations are Assistants-API threads; answers stream from runs.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const state = { key: localStorage.getItem("kt_api_key") || "", assistant: null, model: null,
                  thread: null, run: null, abort: null };

  async function api(path, opts) {
    opts = opts || {};
    const headers = Object.assign({ "Content-Type": "application/json" }, opts.headers || {});
    if (state.key) headers["Authorization"] = "Bearer " + state.key;
    const res = await fetch("/v1" + path, Object.assign({}, opts, { headers: headers }));
    if (res.status === 401) {
      const k = prompt("This server needs an API key:");
      if (k) { state.key = k; localStorage.setItem("kt_api_key", k); return api(path, opts); }
    }
    if (!res.ok) {
      let msg = res.status + " " + res.statusText;
      try { msg = (await res.json()).error.message || msg; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    return opts.raw ? res : res.json();
  }

  function setStatus(text) { $("status").textContent = text || ""; }

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.innerHTML = '<div class="role"></div><div class="body"></div>';
    div.querySelector(".role").textContent = role;
    div.querySelector(".body").innerHTML = renderMarkdown(text);
    $("messages").appendChild(div);
    $("messages").scrollTop = $("messages").scrollHeight;
    return div.querySelector(".body");
  }

  function textOf(msg) {
    return (msg.content || []).filter((p) => p.type === "text").map((p) => p.text.value).join("\n");
  }

  async function ensureAssistant() {
    const models = await api("/models");
    state.model = models.data[0].id;
    $("model-name").textContent = "model: " + state.model;
    const list = await api("/assistants?limit=100");
    state.assistant = list.data.find((a) => (a.metadata || {}).web === "default");
    if (!state.assistant) {
      state.assistant = await api("/assistants", { method: "POST", body: JSON.stringify({
        model: state.model, name: "ktransformers web", instructions: "You are a helpful assistant.",
        metadata: { web: "default" } }) });
    }
  }

  async function loadThreads() {
    const list = await api("/threads?limit=100");
    const ul = $("threads");
    ul.innerHTML = "";
    for (const t of list.data) {
      const li = document.createElement("li");
      li.dataset.id = t.id;
      if (state.thread === t.id) li.className = "active";
      const span = document.createElement("span");
      span.textContent = (t.metadata || {}).title || "Conversation";
      const del = document.createElement("button");
      del.type = "button"; del.title = "Delete"; del.textContent = "×";
      del.onclick = async (ev) => {
        ev.stopPropagation();
        await api("/threads/" + t.id, { method: "DELETE" });
        if (state.thread === t.id) newChat();
        loadThreads();
      };
      li.onclick = () => openThread(t.id);
      li.append(span, del);
      ul.appendChild(li);
    }
  }

  async function openThread(id) {
    if (state.abort) return;
    state.thread = id;
    $("messages").innerHTML = "";
    const list = await api("/threads/" + id + "/messages?order=asc&limit=100");
    for (const m of list.data) addMessage(m.role, textOf(m));
    loadThreads();
  }

  function newChat() {
    if (state.abort) return;
    state.thread = null;
    $("messages").innerHTML = "";
    loadThreads();
    $("input").focus();
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").hidden = !on;
  }

  async function send(text) {
    if (!state.thread) {
      const t = await api("/threads", { method: "POST", body: JSON.stringify({ metadata: { title: text.slice(0, 60) } }) });
      state.thread = t.id;
      loadThreads();
    }
    await api("/threads/" + state.thread + "/messages", { method: "POST",
      body: JSON.stringify({ role: "user", content: text }) });
    addMessage("user", text);
    const body = addMessage("assistant", "");
    body.parentElement.classList.add("streaming");
    let answer = "";
    state.abort = new AbortController();
    busy(true);
    setStatus("generating…");
    try {
      const res = await api("/threads/" + state.thread + "/runs", { method: "POST", raw: true,
        signal: state.abort.signal,
        body: JSON.stringify({ assistant_id: state.assistant.id, stream: true }) });
      const reader = res.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let event = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event: ")) event = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (event === "done") continue;
          const obj = JSON.parse(data);
          if (event === "thread.run.created") state.run = obj.id;
          else if (event === "thread.message.delta") {
            for (const part of obj.delta.content || []) if (part.type === "text") answer += part.text.value;
            body.innerHTML = renderMarkdown(answer);
            $("messages").scrollTop = $("messages").scrollHeight;
          } else if (event === "thread.run.failed") setStatus("failed: " + ((obj.last_error || {}).message || ""));
          else if (event === "thread.run.completed" || event === "thread.run.incomplete") setStatus("");
          else if (event === "thread.run.cancelled") setStatus("stopped");
        }
      }
    } catch (e) {
      setStatus(e.name === "AbortError" ? "stopped" : "error: " + e.message);
    } finally {
      body.parentElement.classList.remove("streaming");
      body.parentElement.classList.add("done");
      state.abort = null;
      state.run = null;
      busy(false);
    }
  }

  async function stop() {
    const run = state.run, thread = state.thread;
    if (state.abort) state.abort.abort();
    if (run && thread) {
      try { await api("/threads/" + thread + "/runs/" + run + "/cancel", { method: "POST" }); } catch (e) { /* already over */ }
    }
  }

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.abort) return;
    $("input").value = "";
    send(text).catch((e) => setStatus("error: " + e.message));
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);

  ensureAssistant().then(loadThreads).then(() => { document.body.dataset.ready = "1"; })
    .catch((e) => setStatus("error: " + e.message));
})();
