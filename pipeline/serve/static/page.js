// The translator page of `pipeline serve` (GET /): this server's own API, nothing from another origin.
// Every text from the server or the user is inserted with textContent / Option(text), never as markup.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const ui = {
    status: $("status"), error: $("error"), keyRow: $("key-row"), key: $("api-key"), keyNote: $("key-note"),
    source: $("source"), target: $("target"), swap: $("swap"), input: $("input"), output: $("output"),
    detected: $("detected"), count: $("count"), altBox: $("alternatives-box"), alts: $("alternatives"),
    altN: $("alternatives-n"), translate: $("translate"), file: $("file"), translateFile: $("translate-file"),
    formats: $("formats"), fileResult: $("file-result"), download: $("download"), copy: $("copy"),
  };
  const store = {
    get(name) { try { return window.localStorage.getItem("pipeline." + name); } catch (e) { return null; } },
    set(name, value) { try { window.localStorage.setItem("pipeline." + name, value); } catch (e) { /* private mode */ } },
  };
  let settings = {};
  let languages = [];           // [{code, name, targets}] of GET /languages
  const names = new Map();      // code -> name
  let detected = null;          // the detected source code of the last translation with "auto"
  let timer = null;
  let inFlight = null;          // the AbortController of the translation under way
  let sequence = 0;             // answers to older requests than the newest are dropped
  let shownFor = null;          // the input whose translation is on screen (swap moves it only for that input)
  const NO_LANGUAGES = "This server translates no languages on LibreTranslate's API (GET /languages lists none): " +
    "none of its models records its language pair. Its operator can serve one as --model de-en=MODEL_DIR.";

  function showError(message) {
    ui.error.textContent = message;
    ui.error.hidden = !message;
  }
  function setStatus(message) { ui.status.textContent = message; }
  // What failed, in words: fetch's own TypeError ("Failed to fetch") is a server that cannot be reached.
  function failure(e, what) {
    if (e instanceof TypeError) return `${what}: cannot reach the server (${e.message}); check that it is running`;
    return e.message || String(e);
  }
  function nameOf(code) { return names.get(code) || code; }

  // An answer's JSON, or an Error carrying the server's {"error"} (or its status line when not JSON).
  async function answer(response, what) {
    let body = null;
    const text = await response.text();
    try { body = JSON.parse(text); } catch (e) { body = null; }
    if (!response.ok) {
      let message = body && typeof body.error === "string" ? body.error : (text.trim().slice(0, 200) || response.statusText);
      message = `${what}: ${response.status} ${message}`;
      if (response.status === 404 && !(body && body.error)) message += " (this server has no such route)";
      const retry = response.headers.get("Retry-After");
      if (retry && !/retry/i.test(message)) message += ` (retry after ${retry} s)`;
      throw new Error(message);
    }
    if (body === null) throw new Error(`${what}: the server's answer is not JSON`);
    return body;
  }

  function option(code, label) { return new Option(label, code); }

  function fillSources() {
    const fallback = settings.language && settings.language.source && settings.language.source.code;
    const keep = ui.source.value || store.get("source") || fallback || "auto";
    // "Auto detect" only where the server detects (its settings' default source is then auto)
    ui.source.replaceChildren(...(fallback === "auto" ? [option("auto", "Auto detect")] : []));
    for (const lang of languages) {
      if (lang.targets && lang.targets.length) ui.source.append(option(lang.code, `${lang.name} (${lang.code})`));
    }
    for (const code of [keep, fallback]) {
      ui.source.value = code;
      if (ui.source.value === code) return;
    }
    ui.source.selectedIndex = 0;
  }

  function targetsOf(source) {
    if (source !== "auto") {
      const lang = languages.find((l) => l.code === source);
      return lang ? lang.targets : [];
    }
    const all = new Set();
    for (const lang of languages) for (const t of lang.targets || []) all.add(t);
    return languages.map((l) => l.code).filter((c) => all.has(c));
  }

  function fillTargets(prefer) {
    const wanted = [prefer, ui.target.value, store.get("target"),
                    settings.language && settings.language.target && settings.language.target.code];
    ui.target.replaceChildren();
    for (const code of targetsOf(ui.source.value)) ui.target.append(option(code, `${nameOf(code)} (${code})`));
    for (const code of wanted) {
      if (code && [...ui.target.options].some((o) => o.value === code)) { ui.target.value = code; break; }
    }
  }

  function remember() {
    store.set("source", ui.source.value);
    store.set("target", ui.target.value);
  }

  function showDetected(language) {
    detected = language && typeof language.language === "string" ? language.language : null;
    if (!detected) { ui.detected.hidden = true; ui.detected.textContent = ""; return; }
    const confidence = typeof language.confidence === "number" ? `, ${language.confidence}%` : "";
    ui.detected.textContent = `Detected: ${nameOf(detected)} (${detected}${confidence})`;
    ui.detected.hidden = false;
  }

  function showAlternatives(list) {
    ui.alts.replaceChildren();
    for (const text of Array.isArray(list) ? list : []) {
      const item = document.createElement("li");
      const use = document.createElement("button");  // a button: keyboard and screen readers reach it
      use.type = "button";
      use.className = "alternative";
      use.dir = "auto";
      use.textContent = text;
      use.title = "Use this translation";
      use.addEventListener("click", () => {  // the chosen alternative and the translation change places
        const current = ui.output.textContent;
        ui.output.textContent = use.textContent;
        use.textContent = current;
      });
      item.append(use);
      ui.alts.append(item);
    }
    ui.altBox.hidden = ui.alts.children.length === 0;
  }

  // Characters as the server counts them (code points: an emoji is one, where the textarea's length says 2)
  function characters() { return [...ui.input.value].length; }
  function overLimit() { return settings.charLimit > 0 && characters() > settings.charLimit; }

  function updateCount() {
    const limit = settings.charLimit;
    const n = characters();
    ui.count.textContent = limit > 0 ? `${n} / ${limit}` + (n > limit ? ` (${n - limit} over)` : "") : "";
    ui.count.classList.toggle("over", overLimit());
  }

  function clearResult() {
    shownFor = null;
    ui.output.textContent = "";
    showAlternatives([]);
    showDetected(null);
  }

  async function translate() {
    clearTimeout(timer);
    if (inFlight) inFlight.abort();
    const q = ui.input.value;
    const mine = ++sequence;
    // nothing sent: the request aborted above ends here, so its status and a translation of another text go too
    // ("Translating…" stayed for good, and Copy copied the last text's translation beside this one)
    const idle = () => { clearResult(); setStatus(""); inFlight = null; };
    if (!q.trim()) { idle(); showError(""); return; }
    if (!ui.target.value) {
      idle();
      showError(languages.length ? "No target language: GET /languages lists none for this source." : NO_LANGUAGES);
      return;
    }
    if (overLimit()) {  // the whole text stays (a maxlength cut pasted text short without a word)
      idle();
      showError(`The text has ${characters()} characters, more than this server's ${settings.charLimit} for one ` +
                "request (its charLimit): shorten it, or translate it as a file below.");
      return;
    }
    const body = { q, source: ui.source.value, target: ui.target.value, format: "text",
                   alternatives: Math.max(0, parseInt(ui.altN.value, 10) || 0) };
    if (ui.key.value) body.api_key = ui.key.value;
    const controller = new AbortController();
    inFlight = controller;
    setStatus("Translating…");
    try {
      const response = await fetch("translate", { method: "POST", headers: { "Content-Type": "application/json" },
                                                  body: JSON.stringify(body), signal: controller.signal });
      const result = await answer(response, "translate");
      if (mine !== sequence) return;
      showError("");
      ui.output.textContent = typeof result.translatedText === "string" ? result.translatedText : "";
      shownFor = q;
      showDetected(body.source === "auto" ? result.detectedLanguage : null);
      showAlternatives(result.alternatives);
    } catch (e) {
      if (e.name === "AbortError" || mine !== sequence) return;
      clearResult();
      showError(failure(e, "translate"));
    } finally {
      if (mine === sequence) { setStatus(""); inFlight = null; }
    }
  }

  function soon() {
    clearTimeout(timer);
    const wait = Number(settings.frontendTimeout) > 0 ? Number(settings.frontendTimeout) : 500;
    timer = setTimeout(translate, wait);
  }

  function swap() {
    let from = ui.source.value;
    const to = ui.target.value;
    if (from === "auto") from = detected;
    if (!from) { showError("Nothing to swap yet: the source language is not known (auto, nothing detected)."); return; }
    if (![...ui.source.options].some((o) => o.value === to)) {
      showError(`Cannot swap: this server translates nothing from ${nameOf(to)}.`);
      return;
    }
    if (!targetsOf(to).includes(from)) {  // else the targets' first would be taken: a third language, unasked
      showError(`Cannot swap: this server translates nothing from ${nameOf(to)} into ${nameOf(from)}.`);
      return;
    }
    // the texts change places only when the translation on screen is the current input's: text typed or pasted
    // since (its translation still to come) stays, and is translated the other way
    const current = shownFor !== null && shownFor === ui.input.value && !inFlight;
    const translation = current ? ui.output.textContent : "";
    ui.source.value = to;
    fillTargets(from);
    remember();
    if (translation) ui.input.value = translation;
    updateCount();
    translate();
  }

  async function translateFile() {
    const file = ui.file.files && ui.file.files[0];
    ui.fileResult.hidden = true;
    if (!file) { showError("Choose a file first."); return; }
    if (!ui.target.value) { showError(languages.length ? "No target language for this source." : NO_LANGUAGES); return; }
    const form = new FormData();
    form.append("file", file);
    form.append("source", ui.source.value);
    form.append("target", ui.target.value);
    if (ui.key.value) form.append("api_key", ui.key.value);
    setStatus(`Translating ${file.name}…`);
    try {
      const result = await answer(await fetch("translate_file", { method: "POST", body: form }), "translate_file");
      const url = new URL(String(result.translatedFileUrl || ""), window.location.href);
      if (!result.translatedFileUrl || (url.protocol !== "http:" && url.protocol !== "https:")) {
        throw new Error("translate_file: the answer has no translatedFileUrl to download");
      }
      showError("");
      // fetched from this page's own origin and path: behind a TLS proxy without --forwarded-allow-ips the URL
      // is plain http (blocked here as mixed content: "cannot reach the server"), behind a path prefix without
      // --root-path it misses the prefix (a 404)
      ui.download.href = new URL(`download_file/${url.pathname.split("/").pop()}`, window.location.href).href;
      ui.download.textContent = `Download the translation of ${file.name}`;
      ui.fileResult.hidden = false;
    } catch (e) {
      showError(failure(e, "translate_file"));
    } finally {
      setStatus("");
    }
  }

  // The download link is checked first: an expired file (kept minutes, in the server's memory) was a click that
  // did nothing; now the server's reason is shown
  async function download(e) {
    e.preventDefault();
    const href = ui.download.href;
    try {
      const response = await fetch(href, { method: "HEAD" });
      if (!response.ok) await answer(await fetch(href), "download");  // GET: the reason is in its body
      const link = document.createElement("a");  // the server's Content-Disposition names the file
      link.href = href;
      link.download = "";
      link.click();
    } catch (err) {
      ui.fileResult.hidden = true;
      showError(failure(err, "download"));
    }
  }

  async function copyTranslation() {
    try {
      await navigator.clipboard.writeText(ui.output.textContent);
      setStatus("Copied.");
    } catch (e) {
      showError(`copy: the browser refused the clipboard (${e.message || e}); select the translation instead`);
    }
  }

  async function start() {
    setStatus("Loading…");
    try {
      const [s, l] = await Promise.all([
        fetch("frontend/settings").then((r) => answer(r, "frontend/settings")),
        fetch("languages").then((r) => answer(r, "languages")),
      ]);
      settings = s || {};
      languages = Array.isArray(l) ? l : [];
    } catch (e) {
      setStatus("");
      showError(failure(e, "loading the page's settings"));
      return;
    }
    for (const lang of languages) names.set(lang.code, lang.name);
    fillSources();
    fillTargets();
    if (settings.apiKeys || settings.keyRequired) {
      ui.keyRow.hidden = false;
      ui.key.value = store.get("apiKey") || "";
      ui.keyNote.textContent = settings.keyRequired ? "required by this server" :
        "optional: requests without one are served at a lower rate";
    }
    const formats = Array.isArray(settings.supportedFilesFormat) ? settings.supportedFilesFormat : [];
    if (formats.length) {
      ui.file.accept = formats.map((f) => (String(f).startsWith(".") ? f : "." + f)).join(",");
      ui.formats.textContent = formats.join(", ");
    } else if (!settings.filesTranslation) {
      ui.formats.textContent = "this server's settings say it does not translate files";
    }
    updateCount();
    setStatus("");
    if (!languages.length) showError(NO_LANGUAGES);  // a model dir served by its name records no pair

    ui.input.addEventListener("input", () => { updateCount(); soon(); });
    ui.input.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate(); });
    ui.source.addEventListener("change", () => { fillTargets(); remember(); translate(); });
    ui.target.addEventListener("change", () => { remember(); translate(); });
    ui.altN.addEventListener("change", translate);
    ui.translate.addEventListener("click", translate);
    ui.swap.addEventListener("click", swap);
    ui.key.addEventListener("input", () => store.set("apiKey", ui.key.value));
    ui.key.addEventListener("change", translate);
    ui.translateFile.addEventListener("click", translateFile);
    ui.copy.addEventListener("click", copyTranslation);
    ui.download.addEventListener("click", download);
    document.body.dataset.ready = "1";  // for tests and scripts: the settings and languages are in
    if (ui.input.value.trim()) translate();
  }

  start();
})();
