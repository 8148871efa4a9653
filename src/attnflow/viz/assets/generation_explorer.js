// attnflow generation explorer: every token a causal LM generated, and what it drew on, per method.
// Every token reaches the page through textContent, never as HTML.
(function () {
  "use strict";

  var meta = JSON.parse(document.getElementById("attnflow-meta").textContent);
  var $ = function (id) { return document.getElementById(id); };
  var formatValue = attnflowData.formatValue;
  // P prompt tokens, N generated tokens t_1 … t_N, S = P + N − 1 sources; step k (0-based) is
  // token P + k, and its sources are tokens 0 … P + k − 1.
  var P = meta.n_prompt, N = meta.steps.length, S = P + N - 1, T = meta.tokens.length;

  // ----- state ----------------------------------------------------------------------------------
  var names = meta.methods.map(function (m) { return m.name; });
  var preferred = ["grad_rollout", "rollout"].map(function (name) { return names.indexOf(name); })
    .filter(function (index) { return index >= 0; });
  // layer -1: the method's final scores (what explain_generation returns)
  var state = { method: preferred.length ? preferred[0] : 0, layer: -1, step: 0, hover: null };
  var current = null;  // Float32Array [step, source] of the shown method and layer

  function method() { return meta.methods[state.method]; }
  function shownStep() { return state.hover !== null ? state.hover : state.step; }

  // The chunk of the shown scores: the chosen layer's, when the method has it, else the final ones.
  function source() {
    var m = method();
    if (state.layer >= 0 && m.layers && state.layer >= m.first_layer) return { ref: m.layers, index: state.layer - m.first_layer };
    return { ref: m.matrix, index: 0 };
  }
  function layerShown() { return source().ref === method().layers; }

  function stepRow(k) { return current.subarray(k * S, k * S + S); }

  // The colour scale of step k: its largest |score| over the non-special sources (all sources when
  // every one is special; 1 when they are all 0).
  function rowScale(row, k) {
    var vmax = 0, i;
    for (i = 0; i < P + k; i++) if (!meta.special[i]) vmax = Math.max(vmax, Math.abs(row[i]));
    if (!(vmax > 0)) for (i = 0; i < P + k; i++) vmax = Math.max(vmax, Math.abs(row[i]));
    return vmax > 0 ? vmax : 1;
  }

  function colour(score, vmax) {
    var level = Math.min(Math.abs(score) / vmax, 1);
    return "rgba(" + (score < 0 ? "33,102,172" : "217,72,15") + "," + level.toFixed(3) + ")";
  }

  function quoted(i) { return "'" + meta.display[i] + "'"; }

  // ----- the running text -----------------------------------------------------------------------
  var tokenSpans = [];

  // A piece that is only white space shows as visible marks (↵ for a newline), its newlines kept.
  function visible(piece) { return piece.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/ /g, "␣"); }

  function buildTokens() {
    var box = $("tokens");
    for (var i = 0; i < T; i++) {
      var piece = meta.special[i] ? meta.display[i] : meta.pieces[i];
      var parts = /^(\s*)([\s\S]*?)(\s*)$/.exec(piece), lead = parts[1], core = parts[2], trail = parts[3];
      if (!core) { core = visible(piece); lead = ""; trail = piece.indexOf("\n") >= 0 ? "\n" : ""; }
      if (lead) box.appendChild(document.createTextNode(lead));
      var span = document.createElement("span");
      span.className = "tok" + (meta.special[i] ? " special" : "") + (i >= P ? " gen" : "");
      span.dataset.i = String(i);
      span.textContent = core;
      span.title = "#" + i + " " + meta.tokens[i];
      if (i >= P) {
        span.addEventListener("mouseenter", onTokenEnter);
        span.addEventListener("mouseleave", onLeave);
        span.addEventListener("click", onTokenClick);
      }
      box.appendChild(span);
      tokenSpans.push(span);
      if (trail) box.appendChild(document.createTextNode(trail));
    }
  }

  function onTokenEnter(event) { hoverStep(Number(event.currentTarget.dataset.i) - P); }
  function onTokenClick(event) { pinStep(Number(event.currentTarget.dataset.i) - P); }
  function onLeave() { if (state.hover !== null) hoverStep(null); }
  function hoverStep(k) { state.hover = k; if (current) renderStep(); }
  function pinStep(k) { state.step = k; state.hover = null; if (current) renderStep(); }

  // ----- the step-by-source table ---------------------------------------------------------------
  var cells = [], stepRows = [];

  function buildHeatmap() {
    var table = $("heatmap"), header = table.insertRow();
    headerCell(header, "generated ↓ source →", "step");
    headerCell(header, "p", "step");
    for (var j = 0; j < S; j++) {
      var th = headerCell(header, "", "source" + (meta.special[j] ? " special" : ""));
      var label = document.createElement("span");
      label.textContent = meta.display[j];
      th.appendChild(label);
      th.title = "source #" + j + " " + meta.tokens[j];
    }
    for (var k = 0; k < N; k++) {
      var tr = table.insertRow();
      tr.dataset.step = String(k);
      var name = headerCell(tr, meta.display[P + k], "step");
      name.title = "step " + (k + 1) + ": " + meta.tokens[P + k] + ", log p = " + formatValue(meta.steps[k].log_prob);
      var p = tr.insertCell();
      p.className = "p";
      p.textContent = meta.steps[k].probability.toFixed(2);
      var row = [];
      for (j = 0; j < S; j++) {
        var td = tr.insertCell();
        td.className = j < P + k ? "cell" : "cell absent";
        td.dataset.source = String(j);
        row.push(td);
      }
      cells.push(row);
      stepRows.push(tr);
      tr.addEventListener("click", onHeatmapClick);
    }
    table.addEventListener("mouseover", onHeatmapHover);
  }

  function headerCell(tr, text, cls) {
    var th = document.createElement("th");
    th.className = cls;
    th.textContent = text;
    tr.appendChild(th);
    return th;
  }

  function onHeatmapClick(event) { pinStep(Number(event.currentTarget.dataset.step)); }

  function onHeatmapHover(event) {
    var td = event.target.closest("td.cell"), readout = $("heatmap-readout");
    if (!td || !current) return;
    var k = Number(td.parentNode.dataset.step), j = Number(td.dataset.source);
    readout.textContent = j < P + k
      ? "#" + j + " " + quoted(j) + " → " + quoted(P + k) + " (step " + (k + 1) + "): " + formatValue(stepRow(k)[j])
      : "#" + j + " " + quoted(j) + " comes at or after " + quoted(P + k) + ": the model cannot read it";
  }

  function colourHeatmap() {
    for (var k = 0; k < N; k++) {
      var row = stepRow(k), vmax = rowScale(row, k);
      for (var j = 0; j < P + k; j++) cells[k][j].style.backgroundColor = colour(row[j], vmax);
    }
  }

  // ----- the shown step -------------------------------------------------------------------------
  function renderStep() {
    var m = method(), k = shownStep(), row = stepRow(k), vmax = rowScale(row, k), t = P + k;
    for (var i = 0; i < T; i++) {
      var span = tokenSpans[i];
      span.classList.toggle("absent", i > t);
      span.classList.toggle("current", i === t);
      span.classList.toggle("pinned", i === P + state.step);
      if (i < t) {
        span.style.backgroundColor = colour(row[i], vmax);
        span.style.color = Math.abs(row[i]) / vmax > 0.6 ? "#fff" : "#111";
        span.title = "#" + i + " " + meta.tokens[i] + "  score " + formatValue(row[i]);
      } else {
        span.style.backgroundColor = "";
        span.style.color = "";
        span.title = "#" + i + " " + meta.tokens[i] + (i === t ? "  (the token explained)" : "  (after it: not read)");
      }
    }
    for (var r = 0; r < N; r++) stepRows[r].classList.toggle("current", r === k);
    var where = layerShown() ? "after layer " + state.layer : "final";
    $("tokens-caption").textContent = "sources of " + quoted(t) + " (step " + (k + 1) + "), " + m.name + ", " + where;
    $("step-caption").textContent = (k + 1) + " of " + N + " · " + m.name + " · " + where;
    $("step-token").textContent = quoted(t) + (meta.special[t] ? " (special token)" : "");
    var step = meta.steps[k];
    $("step-probability").textContent = "p(" + quoted(t) + " | everything before) = " + formatValue(step.probability) +
      " (log p = " + formatValue(step.log_prob) + ")";
    $("step-top").textContent = "top sources: " + topSources(m, k, row).map(function (pair) {
      return "#" + pair[0] + " " + quoted(pair[0]) + " " + formatValue(pair[1]);
    }).join(" · ");
    showFaithfulness(m, k);
    var extras = m.extras && m.extras[k] ? Object.keys(m.extras[k]) : [];
    $("step-extras").hidden = !extras.length;
    $("step-extras").textContent = extras.map(function (key) {
      var value = m.extras[k][key];
      return key + ": " + (typeof value === "number" ? formatValue(value) : JSON.stringify(value));
    }).join(" · ");
    $("scale-bar").classList.toggle("signed", !!m.signed);
    $("legend-min").textContent = m.signed ? formatValue(-vmax) : "0";
    $("legend-max").textContent = formatValue(vmax);
    $("legend-text").textContent = m.signed
      ? "signed scores: orange supports the token, blue speaks against it (scaled to the step's largest |score| of a non-special source)"
      : "colour ∝ score, scaled to the step's largest non-special source; blue: negative";
  }

  // [source index, score] of step k's best sources, special tokens left out: the exact ones the
  // page carries for the final scores, else ranked from the shown layer's decoded row.
  function topSources(m, k, row) {
    if (!layerShown()) return m.top[k];
    var order = [];
    for (var j = 0; j < P + k; j++) if (!meta.special[j]) order.push(j);
    order.sort(function (a, b) { return row[b] - row[a] || a - b; });
    return order.slice(0, meta.top_sources).map(function (j) { return [j, row[j]]; });
  }

  function showFaithfulness(m, k) {
    var box = $("step-faithfulness"), f = m.faithfulness;
    box.hidden = !f;
    if (!f) { box.textContent = ""; return; }
    var bins = f.bins.map(function (b) { return Math.round(b * 100) + " %"; }).join(", ");
    box.textContent = "faithfulness of this step: AOPC " + formatValue(f.aopc[k]) + " (mean over steps " +
      formatValue(f.mean_aopc) + "); p once its top " + bins + " of sources are " + f.replace + "d: " +
      f.perturbed[k].map(formatValue).join(", ");
  }

  // ----- controls and rendering -----------------------------------------------------------------
  function option(select, value, text) {
    var o = document.createElement("option");
    o.value = value;
    o.textContent = text;
    select.appendChild(o);
  }

  function fillLayers() {
    var m = method(), select = $("layer");
    select.textContent = "";
    option(select, "-1", "final");
    if (m.layers) for (var l = m.first_layer; l < meta.n_layers; l++) option(select, String(l), "after layer " + l);
    select.disabled = !m.layers;
    select.title = m.layers ? "" : m.name + " gives its final scores only";
    if (!m.layers || state.layer < m.first_layer) state.layer = -1;
    select.value = String(state.layer);
  }

  function fillSelectors() {
    var methods = $("method");
    meta.methods.forEach(function (m, index) { option(methods, String(index), m.name + (m.signed ? " (signed)" : "")); });
    methods.value = String(state.method);
    methods.addEventListener("change", function () { state.method = Number(methods.value); fillLayers(); render(); });
    $("layer").addEventListener("change", function () { state.layer = Number($("layer").value); render(); });
    fillLayers();
  }

  // A render inflates the chunk it shows first (asynchronously, unless cached), then draws; a newer
  // render supersedes one still waiting. body[data-busy] is "1" until it has drawn.
  var renderSerial = 0;

  function render() {
    document.body.dataset.busy = "1";
    var serial = ++renderSerial, started = performance.now(), shown = source();
    attnflowData.load(shown.ref, shown.index).then(function () {
      if (serial === renderSerial) draw(shown, started);
    }, failed);
  }

  function failed(error) {
    $("method-note").textContent = "could not decode the page's data (" + error + "); the explorer needs a browser " +
      "with DecompressionStream: Chrome or Edge 80, Firefox 113, Safari 16.4 or later";
    document.body.dataset.busy = "0";
    throw error;
  }

  function draw(shown, started) {
    var m = method();
    current = attnflowData.read(shown.ref, shown.index);
    var options = Object.keys(m.options).map(function (key) { return key + "=" + m.options[key]; }).join(", ");
    $("method-note").textContent = m.description + (options ? " (" + options + ")" : "") +
      (m.layers ? "" : " — final scores only (no per-layer view)");
    $("notes").hidden = !m.notes.length;
    $("notes").textContent = m.notes.length ? "Warning: " + m.notes.join(" · ") : "";
    colourHeatmap();
    renderStep();
    var elapsed = performance.now() - started;
    $("timing").textContent = "drawn in " + elapsed.toFixed(0) + " ms";
    document.body.dataset.busy = "0";
    document.body.dataset.ready = "1";
  }

  function init() {
    buildTokens();
    buildHeatmap();
    fillSelectors();
    var skipped = Object.keys(meta.skipped || {});
    $("skipped").textContent = skipped.length
      ? "Not shown: " + skipped.map(function (name) { return name + " (" + meta.skipped[name] + ")"; }).join("; ")
      : "";
    render();
  }

  // For tests and scripts: the decoded values of chunk `index` of a data reference in `meta`
  // (e.g. attnflowGeneration.values(attnflowGeneration.meta.methods[0].layers, 3): layer first_layer + 3).
  window.attnflowGeneration = {
    meta: meta,
    values: function (ref, index) {
      return attnflowData.load(ref, index).then(function () { return attnflowData.read(ref, index); });
    },
  };

  init();
})();
