// ktransformers chat page: conversations are Assistants-API threads; answers stream from runs.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const state = { key: localStorage.getItem("kt_api_key") || "", assistant: null, model: null,
                  thread: null, run: null, abort: null, images: [] };

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

  function addMessage(role, text, images) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.innerHTML = '<div class="role"></div><div class="body"></div>';
    div.querySelector(".role").textContent = role;
    div.querySelector(".body").innerHTML = renderMarkdown(text);
    for (const url of images || []) {
      const img = document.createElement("img");
      img.className = "attached";
      img.src = url;
      div.insertBefore(img, div.querySelector(".body"));
    }
    $("messages").appendChild(div);
    $("messages").scrollTop = $("messages").scrollHeight;
    return div.querySelector(".body");
  }

  function textOf(msg) {
    return (msg.content || []).filter((p) => p.type === "text").map((p) => p.text.value).join("\n");
  }

  function imagesOf(msg) {
    return (msg.content || []).filter((p) => p.type === "image_url").map((p) => p.image_url.url);
  }

  // a model that takes images says so in Ollama's /api/show capabilities ("vision")
  async function checkVision() {
    const headers = { "Content-Type": "application/json" };
    if (state.key) headers["Authorization"] = "Bearer " + state.key;
    const res = await fetch("/api/show", { method: "POST", headers: headers, body: JSON.stringify({ model: state.model }) });
    const caps = res.ok ? ((await res.json()).capabilities || []) : [];
    $("attach").hidden = !caps.includes("vision");
  }

  function showAttached() {
    const n = state.images.length;
    $("attached").textContent = n ? n + (n === 1 ? " image" : " images") + " attached" : "";
  }

  function readAsDataURL(file) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(r.result);
      r.onerror = () => reject(r.error);
      r.readAsDataURL(file);
    });
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
    for (const m of list.data) addMessage(m.role, textOf(m), imagesOf(m));
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
    const images = state.images;
    const content = images.length
      ? images.map((url) => ({ type: "image_url", image_url: { url: url } })).concat([{ type: "text", text: text }])
      : text;
    await api("/threads/" + state.thread + "/messages", { method: "POST",
      body: JSON.stringify({ role: "user", content: content }) });
    state.images = [];
    showAttached();
    addMessage("user", text, images);
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
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", async (ev) => {
    for (const f of ev.target.files) state.images.push(await readAsDataURL(f));
    ev.target.value = "";
    showAttached();
  });
  $("attached").addEventListener("click", () => { state.images = []; showAttached(); });
  $("new-chat").addEventListener("click", newChat);

  ensureAssistant().then(checkVision).then(loadThreads).then(() => { document.body.dataset.ready = "1"; })
    .catch((e) => setStatus("error: " + e.message));
})();
