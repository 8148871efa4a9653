/* attnflow serve: the page. It asks the JSON API on its own origin and draws the answers; every
   token string goes into the DOM as text (textContent), never as HTML. */
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const AUTO = "auto";
  const state = { methods: [], history: [], shown: null, view: 0, pinned: null, running: null, asks: 0, kinds: {},
                  records: {}, touched: false };
  // What a model is asked by default: a prompt and auto for a causal LM (rollout there puts nearly
  // everything on the first token), a review with auto and rollout for a classifier.
  const PROMPTS = { next_token: "The capital of France is", other: "The movie was terrible, but the acting was great." };

  function setStatus(text, isError) {
    $("status").textContent = text;
    $("status").className = isError ? "status error" : "status";
  }

  async function api(path, body) {
    const options = body === undefined ? {} : {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
    };
    const response = await fetch(path, options);
    let data = null;
    try { data = await response.json(); } catch (error) { data = { error: "the server answered " + response.status }; }
    if (!response.ok) throw new Error((data && data.error) || ("the server answered " + response.status));
    return data;
  }

  function option(select, value, label) {
    const element = document.createElement("option");
    element.value = value;
    element.textContent = label;
    select.appendChild(element);
  }

  function methodBox(name, summary, cost, checked) {
    const label = document.createElement("label");
    label.title = summary;
    label.dataset.summary = summary;
    const box = document.createElement("input");
    box.type = "checkbox";
    box.value = name;
    box.checked = checked;
    label.appendChild(box);
    label.appendChild(document.createTextNode(name));
    if (cost === "expensive") {
      const note = document.createElement("span");
      note.className = "cost";
      note.textContent = "(slow)";
      label.appendChild(note);
    }
    $("methods").appendChild(label);
  }

  function dropToken() {
    // /?token=T set the page's cookie: the token leaves the address bar (and the history) at once
    const url = new URL(window.location.href);
    if (!url.searchParams.has("token")) return;
    url.searchParams.delete("token");
    history.replaceState(history.state, "", url.pathname + url.search + url.hash);
  }

  async function start() {
    dropToken();
    try {
      const [models, methods] = await Promise.all([api("/api/models"), api("/api/methods")]);
      for (const model of models.models) {
        option($("model"), model.name, model.name + (model.default ? " (default)" : ""));
        if (model.loaded) state.records[model.name] = model;
      }
      methodBox(AUTO, "the one-pass target method with the highest comprehensiveness on this input", "backward", true);
      for (const method of methods.methods) methodBox(method.name, method.summary, method.cost, method.name === "rollout");
      state.methods = methods.methods;
      await chooseModel();
      setStatus("ready: " + $("model").value);
    } catch (error) {
      setStatus(error.message, true);
    }
    document.body.dataset.ready = "1";
  }

  // The chosen model, loaded (once): its methods offered, the others greyed with the reason the
  // server refuses them with, and its kind's defaults while the user has not chosen methods.
  async function chooseModel() {
    const name = $("model").value;
    let record = state.records[name];
    if (!record) {
      setStatus("loading " + name + " …");
      $("methods").disabled = true;
      try {
        record = state.records[name] = await api("/api/load", { model: name });
      } finally {
        $("methods").disabled = false;
      }
      setStatus("ready: " + name);
    }
    if ($("model").value !== name) return;  // chosen again meanwhile: that choice applies
    if (record.target_kind) state.kinds[name] = record.target_kind;
    const unsupported = record.unsupported || {};
    const llm = record.target_kind === "next_token";
    for (const box of $("methods").querySelectorAll("input")) {
      const reason = unsupported[box.value];
      const label = box.parentElement;
      box.disabled = !!reason;
      label.classList.toggle("unsupported", !!reason);
      label.title = reason ? "not for " + name + ": " + reason : label.dataset.summary;
      if (reason) box.checked = false;
      else if (!state.touched) box.checked = box.value === AUTO || (!llm && box.value === "rollout");
    }
    $("text").placeholder = llm ? PROMPTS.next_token : PROMPTS.other;
  }

  function chosenMethods() {
    return Array.from($("methods").querySelectorAll("input:checked")).map((box) => box.value);
  }

  function newId() {
    const bytes = new Uint8Array(12);
    crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  async function ask(event) {
    event.preventDefault();
    if (state.running) return;
    const text = $("text").value;
    const generate = parseInt($("generate").value || "0", 10);
    const methods = chosenMethods();
    const requestId = newId();
    const body = { text: text, model: $("model").value, request_id: requestId };
    let path = "/api/explain";
    if (generate > 0) {
      path = "/api/generate";
      body.generate = generate;
      body.methods = methods.length ? methods : null;  // none: auto, as the command line
    } else {
      body.methods = methods.length ? methods : null;
      if ($("target").value) body.target = $("target").value;
      if ($("target-text").value) body.target_text = $("target-text").value;
    }
    state.running = requestId;
    state.asks += 1;
    document.body.dataset.busy = "1";
    $("run").disabled = true;
    $("cancel").disabled = false;
    setStatus("working …");
    const poll = setInterval(async () => {
      try {
        const progress = await api("/api/progress/" + requestId);
        if (progress.running && state.running === requestId) {  // an answer that came meanwhile keeps its status
          setStatus("working: " + progress.step + " (" + progress.forward_passes + " forward passes, " +
                    progress.elapsed_s.toFixed(1) + " s)");
        }
      } catch (error) { /* finished meanwhile */ }
    }, 400);
    try {
      const answer = await api(path, body);
      const entry = { id: answer.id, kind: generate > 0 ? "generation" : "explanation", text: text,
                      model: body.model, generate: generate, explanations: answer.explanations,
                      skipped: answer.skipped || [], elapsed: answer.elapsed_ms, views: {} };
      state.history.push(entry);
      addToHistory(entry, state.history.length - 1);
      await learnKinds();
      show(entry, 0);
      setStatus("done in " + answer.elapsed_ms.toFixed(0) + " ms");
    } catch (error) {
      setStatus(error.message, true);
      hideShown();  // the previous result is not this text's: it stays in the history, not under the form
    } finally {
      clearInterval(poll);
      state.running = null;
      $("run").disabled = false;
      $("cancel").disabled = true;
      document.body.dataset.busy = "0";
    }
  }

  async function cancel() {
    if (!state.running) return;
    try { await api("/api/cancel/" + state.running, {}); } catch (error) { /* it finished */ }
  }

  // A view of the shown answer that the server builds as a page of its own (the explorer, the
  // routes): the button waits for it, then the link opens it in a new tab.
  async function openView(button, link, path, body, waiting, ready) {
    const entry = state.shown;
    if (!entry || entry.kind !== "explanation") return;
    $(button).disabled = true;
    setStatus(waiting);
    try {
      const answer = await api(path, body(entry));
      entry.views[link] = answer.url;  // the link belongs to this entry: shown with it, never beside another
      if (state.shown === entry) {
        showViewLinks(entry);
        setStatus(ready(answer));
      }
    } catch (error) {
      setStatus(error.message, true);
    } finally {
      $(button).disabled = false;
    }
  }

  function exploreShown() {
    return openView("explore", "explorer-link", "/api/explore",
      (entry) => ({ text: entry.text, model: entry.model, methods: entry.explanations.map((e) => e.method) }),
      "building the explorer (every layer and head) …", () => "the explorer is ready: open it in a new tab");
  }

  function routesShown() {
    return openView("routes", "routes-link", "/api/routes", (entry) => ({ text: entry.text, model: entry.model }),
      "building the routes (one forward pass, every part of every block) …",
      (answer) => "the routes are ready (" + answer.routes.route.nodes.length + " nodes, " +
        answer.routes.route.edges.length + " edges at threshold " + answer.routes.threshold + "): open them in a new tab");
  }

  // attnflow why on the shown text: the reading (paragraphs written as text), then the evidence
  // sections of why.html below it (built by attnflow.viz.why, every token and text escaped there).
  async function whyShown() {
    const entry = state.shown;
    if (!entry || entry.kind !== "explanation") return;
    $("why").disabled = true;
    setStatus("asking why (every kind of evidence, within the server's time limit) …");
    try {
      const answer = await api("/api/why", { text: entry.text, model: entry.model });
      entry.why = answer;
      entry.views["why-link"] = answer.url;
      if (state.shown === entry) {
        showViewLinks(entry);
        showWhy(entry);
        const dropped = answer.why.plan.dropped || [];
        setStatus("why: done in " + answer.elapsed_ms.toFixed(0) + " ms" +
          (dropped.length ? "; dropped for the time limit: " + dropped.join(", ") : ""));
      }
    } catch (error) {
      setStatus(error.message, true);
    } finally {
      $("why").disabled = false;
    }
  }

  function showWhy(entry) {
    const paragraphs = $("why-paragraphs");
    paragraphs.textContent = "";
    $("why-evidence").textContent = "";
    $("why-view").hidden = !entry.why;
    if (!entry.why) return;
    for (const paragraph of entry.why.why.paragraphs) {
      const question = document.createElement("h3");
      question.textContent = paragraph.question;
      const text = document.createElement("p");
      text.textContent = paragraph.text;
      paragraphs.append(question, text);
    }
    $("why-evidence").innerHTML = entry.why.page;  // escaped markup of attnflow.viz.why.why_fragment
  }

  async function learnKinds() {
    try {
      const models = await api("/api/models");
      for (const model of models.models) if (model.target_kind) state.kinds[model.name] = model.target_kind;
    } catch (error) { /* the routes button stays hidden */ }
  }

  function hideShown() {
    state.shown = null;
    $("result").hidden = true;
  }

  function addToHistory(entry, index) {
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    const names = entry.explanations.map((e) => e.method).join(", ");
    button.textContent = entry.text.slice(0, 80) + (entry.text.length > 80 ? "…" : "") + " · " + entry.model + " · " + names;
    button.addEventListener("click", () => show(state.history[index], 0));
    item.appendChild(button);
    $("history").appendChild(item);
  }

  function label(explanation) {
    return explanation.chosen_by ? "auto → " + explanation.method : explanation.method;
  }

  // The pages built for an entry (the explorer, the routes), each link shown only beside its entry.
  function showViewLinks(entry) {
    for (const link of ["explorer-link", "routes-link", "why-link"]) {
      const url = entry.views[link];
      $(link).hidden = !url;
      if (url) $(link).href = url;
      else $(link).removeAttribute("href");
    }
  }

  function show(entry, view) {
    state.shown = entry;
    const select = $("view-method");
    select.textContent = "";
    entry.explanations.forEach((explanation, index) => option(select, String(index), label(explanation)));
    select.value = String(view);
    $("result").hidden = false;
    // the form shows what this result answered: its text, model and generation length
    $("text").value = entry.text;
    const otherModel = $("model").value !== entry.model;
    $("model").value = entry.model;
    if (otherModel) chooseModel().catch((error) => setStatus(error.message, true));  // its methods again
    $("generate").value = String(entry.generate || 0);
    $("result-source").textContent = entry.model + " · " + entry.text +
      (entry.kind === "generation" ? " · " + entry.generate + " generated tokens" : "");
    $("skipped").textContent = (entry.skipped || []).map((s) => "skipped " + s.method + ": " + s.reason).join("; ");
    showViewLinks(entry);
    $("explore").hidden = entry.kind !== "explanation";
    $("routes").hidden = entry.kind !== "explanation" || state.kinds[entry.model] !== "next_token";
    $("why").hidden = entry.kind !== "explanation" || !["next_token", "class"].includes(state.kinds[entry.model]);
    showWhy(entry);
    draw(view);
  }

  function colour(score, scale, signed) {
    const strength = scale > 0 ? Math.min(1, Math.abs(score) / scale) : 0;
    const alpha = (0.85 * strength).toFixed(3);
    return signed && score < 0 ? "rgba(33,102,172," + alpha + ")" : "rgba(217,72,15," + alpha + ")";
  }

  function scaleOf(scores, special) {
    let scale = 0;
    scores.forEach((score, i) => { if (!(special && special[i])) scale = Math.max(scale, Math.abs(score)); });
    return scale;
  }

  function tokenSpan(token, score, index, special) {
    const span = document.createElement("span");
    span.className = special ? "tok special" : "tok";
    span.textContent = token;
    span.dataset.index = String(index);
    span.dataset.score = String(score);
    span.title = token + ": " + score.toPrecision(4);
    return span;
  }

  function paint(scores, special, signed) {
    const scale = scaleOf(scores, special);
    $("tokens").querySelectorAll(".tok").forEach((span) => {
      const i = Number(span.dataset.index);
      span.dataset.score = String(scores[i]);
      span.title = span.textContent + ": " + scores[i].toPrecision(4);
      span.style.backgroundColor = colour(scores[i], scale, signed);
    });
  }

  function badgeText(f) {
    return "comprehensiveness " + f.aopc_comprehensiveness.toFixed(2) + " (random " +
      f.random.aopc_comprehensiveness.toFixed(2) + ") · sufficiency " + f.aopc_sufficiency.toFixed(2) +
      " (random " + f.random.aopc_sufficiency.toFixed(2) + ")";
  }

  function draw(view) {
    const entry = state.shown;
    const explanation = entry.explanations[view];
    state.view = view;
    state.pinned = null;
    document.body.dataset.method = explanation.method;
    for (const kind of ["json", "html", "png"]) {
      const link = $("dl-" + kind);
      link.href = "/api/results/" + encodeURIComponent(entry.id) + "/" + encodeURIComponent(explanation.method) + "." + kind;
      link.download = entry.kind + "-" + explanation.method + "." + kind;
    }
    const target = explanation.target || explanation.prediction;
    $("prediction").textContent = target ? "explains: " + target.label +
      (target.probability !== undefined && target.probability !== null ? " (p = " + Number(target.probability).toFixed(3) + ")" : "") : "";
    $("chosen").textContent = explanation.chosen_by || "";
    const faithful = explanation.faithfulness;
    $("badge").hidden = !(faithful && faithful.random && faithful.aopc_comprehensiveness !== undefined);
    $("badge").textContent = $("badge").hidden ? "" : "faithfulness on this input: " + badgeText(faithful);
    $("notes").textContent = "";
    for (const note of explanation.notes || []) {
      const item = document.createElement("li");
      item.textContent = note;
      $("notes").appendChild(item);
    }
    $("tokens").textContent = "";
    $("steps").textContent = "";
    if (entry.kind === "generation") return drawSteps(explanation);
    const special = explanation.special_mask || [];
    const shown = explanation.display_tokens || explanation.tokens;  // as a reader sees them
    shown.forEach((token, i) => $("tokens").appendChild(tokenSpan(token, explanation.scores[i], i, special[i])));
    paint(explanation.scores, special, !!explanation.signed);
    $("row-info").textContent = explanation.matrix
      ? "Click a token to see what it draws on (row " + explanation.row + " shown)."
      : explanation.method + " gives one score per token (no matrix).";
  }

  function pin(event) {
    const span = event.target.closest(".tok");
    const explanation = state.shown && state.shown.explanations[state.view];
    if (!span || !explanation || !explanation.matrix || state.shown.kind !== "explanation") return;
    const i = Number(span.dataset.index);
    $("tokens").querySelectorAll(".tok.pinned").forEach((other) => other.classList.remove("pinned"));
    if (state.pinned === i) {
      state.pinned = null;
      paint(explanation.scores, explanation.special_mask || [], !!explanation.signed);
      $("row-info").textContent = "row " + explanation.row + " (the saliency row) shown.";
      return;
    }
    state.pinned = i;
    span.classList.add("pinned");
    paint(explanation.matrix[i], explanation.special_mask || [], !!explanation.signed);
    $("row-info").textContent = "row " + i + " (" + span.textContent + "): what this position draws on; click it again for the saliency row.";
  }

  function drawSteps(explanation) {
    const table = document.createElement("table");
    const head = table.insertRow();
    for (const title of ["step", "token", "p", "sources"]) {
      const cell = document.createElement("th");
      cell.textContent = title;
      head.appendChild(cell);
    }
    const generated = explanation.display_generated || explanation.generated;  // as a reader sees them
    const sourceTokens = explanation.display_sources || explanation.sources;
    explanation.steps.forEach((step, k) => {
      const row = table.insertRow();
      row.insertCell().textContent = String(k + 1);
      row.insertCell().textContent = generated[k];
      row.insertCell().textContent = step.probability.toFixed(3);
      const sources = row.insertCell();
      const scores = explanation.matrix[k];
      const scale = scaleOf(scores, explanation.special_mask);
      scores.forEach((score, i) => {
        const span = tokenSpan(sourceTokens[i], score, i, explanation.special_mask[i]);
        span.style.backgroundColor = colour(score, scale, score < 0);
        sources.appendChild(span);
      });
    });
    $("steps").appendChild(table);
    $("row-info").textContent = "Each row: the generated token and what it drew on (" + explanation.method + ").";
  }

  $("ask").addEventListener("submit", ask);
  $("methods").addEventListener("change", () => { state.touched = true; });
  $("model").addEventListener("change", () => chooseModel().catch((error) => setStatus(error.message, true)));
  $("cancel").addEventListener("click", cancel);
  $("explore").addEventListener("click", exploreShown);
  $("routes").addEventListener("click", routesShown);
  $("why").addEventListener("click", whyShown);
  $("view-method").addEventListener("change", (event) => draw(Number(event.target.value)));
  $("tokens").addEventListener("click", pin);
  document.body.dataset.busy = "0";
  start();
})();
