// attnflow explorer: a small viewer for the data blocks that attnflow.viz.explorer writes.
// Every token reaches the page through textContent or canvas text, never as HTML.
(function () {
  "use strict";

  var meta = JSON.parse(document.getElementById("attnflow-meta").textContent);
  var n = meta.tokens.length;
  var $ = function (id) { return document.getElementById(id); };

  var load = attnflowData.load, read = attnflowData.read, cached = attnflowData.cached;
  var formatValue = attnflowData.formatValue;

  // ----- state ----------------------------------------------------------------------------------
  var preferred = meta.methods.map(function (m) { return m.name; }).indexOf(meta.opens_on);
  var state = { method: preferred >= 0 ? preferred : 0, layer: meta.n_layers - 1, head: -1, row: meta.row, hover: null, scale: "sqrt" };

  function method() { return meta.methods[state.method]; }

  // A layer's label: its block index in a hybrid stack (attention in some blocks only), else itself.
  function layerLabel(l) { return String(meta.layer_labels ? meta.layer_labels[l] : l); }

  // The view index of the selected layer for a method (-1: the method has no matrix for it).
  function viewIndex(m) {
    if (!m.matrices) return -1;
    if (m.first_layer === null) return 0;
    var view = state.layer - m.first_layer;
    return view >= 0 && view < m.matrices.shape[0] ? view : -1;
  }

  function headShown(m) { return state.head >= 0 && m.heads ? state.head : -1; }

  // The chunk of the shown matrix: {ref, index}, or null.
  function matrixSource() {
    var m = method(), view = viewIndex(m);
    if (view < 0) return null;
    var head = headShown(m);
    return head < 0 ? { ref: m.matrices, index: view } : { ref: m.heads, index: view * meta.n_heads + head };
  }

  function currentMatrix() {
    var source = matrixSource();
    return source ? read(source.ref, source.index) : null;
  }

  // Saliency scores: a row of the matrix ("cls", "mean", "last" or a query index).
  function rowScores(matrix, row) {
    var out = new Float32Array(n), i, j;
    if (row === "mean") {
      for (i = 0; i < n; i++) for (j = 0; j < n; j++) out[j] += matrix[i * n + j] / n;
      return out;
    }
    var r = row === "cls" ? 0 : row === "last" ? n - 1 : row;
    for (j = 0; j < n; j++) out[j] = matrix[r * n + j];
    return out;
  }

  function rowLabel(row) {
    if (row === "mean") return "mean of all rows";
    if (row === "cls") return "row 0 (" + meta.display[0] + ")";
    if (row === "last") return "last row (" + meta.display[n - 1] + ")";
    return "row " + row + " ('" + meta.display[row] + "')";
  }

  // ----- colours --------------------------------------------------------------------------------
  function sequentialLut() {
    var stops = [[255, 255, 255], [254, 230, 206], [253, 174, 107], [241, 105, 19], [166, 54, 3], [90, 20, 2]];
    return lut(function (t) { return interpolate(stops, t); });
  }
  function divergingLut() {
    var stops = [[33, 102, 172], [103, 169, 207], [209, 229, 240], [255, 255, 255], [253, 219, 199], [239, 138, 98], [178, 24, 43]];
    return lut(function (t) { return interpolate(stops, t); });
  }
  function interpolate(stops, t) {
    var x = Math.min(Math.max(t, 0), 1) * (stops.length - 1), k = Math.min(Math.floor(x), stops.length - 2), f = x - k;
    return [0, 1, 2].map(function (c) { return Math.round(stops[k][c] + f * (stops[k + 1][c] - stops[k][c])); });
  }
  // 256 colours as packed RGBA pixels (ImageData's bytes R, G, B, A on a little-endian machine).
  function lut(colour) {
    var table = new Uint32Array(256);
    for (var i = 0; i < 256; i++) { var c = colour(i / 255); table[i] = (c[0] | (c[1] << 8) | (c[2] << 16) | (255 << 24)) >>> 0; }
    return table;
  }
  var SEQUENTIAL = sequentialLut(), DIVERGING = divergingLut();

  // ----- tokens ---------------------------------------------------------------------------------
  var tokenSpans = [];

  function buildTokens() {
    var box = $("tokens"), cursor = 0, text = meta.text, offsets = meta.offsets;
    var useText = !!text && !!offsets;
    for (var i = 0; i < n; i++) {
      var span = document.createElement("span");
      span.className = "tok" + (meta.special[i] ? " special" : "");
      span.dataset.i = String(i);
      var shown = meta.display[i];
      if (!meta.special[i] && useText && offsets[i][1] > offsets[i][0] && offsets[i][1] > cursor) {
        var start = Math.max(offsets[i][0], cursor);
        if (start > cursor) box.appendChild(document.createTextNode(text.slice(cursor, start)));
        shown = text.slice(start, offsets[i][1]);
        cursor = offsets[i][1];
      } else if (!useText && i > 0) {
        box.appendChild(document.createTextNode(" "));
      }
      span.textContent = shown;
      span.title = "#" + i + " " + meta.tokens[i];
      span.addEventListener("mouseenter", onTokenEnter);
      span.addEventListener("mouseleave", onTokenLeave);
      span.addEventListener("click", onTokenClick);
      box.appendChild(span);
      tokenSpans.push(span);
    }
    if (useText && cursor < text.length) {
      var rest = document.createElement("span");
      rest.className = "unseen";
      rest.title = "not seen by the model (truncated)";
      rest.textContent = text.slice(cursor);
      box.appendChild(rest);
    }
  }

  function onTokenEnter(event) {
    if (!method().matrices) return;
    state.hover = Number(event.currentTarget.dataset.i);
    renderRow();
  }
  function onTokenLeave() {
    if (state.hover === null) return;
    state.hover = null;
    renderRow();
  }
  function onTokenClick(event) {
    if (!method().matrices) return;
    pinRow(Number(event.currentTarget.dataset.i));
  }
  function pinRow(i) {
    state.row = i;
    state.hover = null;
    fillRowSelect();
    renderRow();
  }

  function colourTokens(scores) {
    var vmax = 0, i;
    for (i = 0; i < n; i++) if (!meta.special[i]) vmax = Math.max(vmax, Math.abs(scores[i]));
    if (!(vmax > 0)) for (i = 0; i < n; i++) vmax = Math.max(vmax, Math.abs(scores[i]));
    if (!(vmax > 0)) vmax = 1;
    for (i = 0; i < n; i++) {
      var level = Math.min(Math.abs(scores[i]) / vmax, 1);
      var rgb = scores[i] < 0 ? "33,102,172" : "217,72,15";
      tokenSpans[i].style.backgroundColor = "rgba(" + rgb + "," + level.toFixed(3) + ")";
      tokenSpans[i].style.color = level > 0.6 ? "#fff" : "#111";
      tokenSpans[i].title = "#" + i + " " + meta.tokens[i] + "  score " + formatValue(scores[i]);
    }
    $("legend-max").textContent = formatValue(vmax);
    return vmax;
  }

  // ----- matrices on canvas ---------------------------------------------------------------------
  var matrixState = { matrix: null, margin: 0 };
  var similarityState = { matrix: null, margin: 0 };

  // holder.css: the canvas's CSS width, measured by draw() before it changes the DOM (measuring
  // here would force a layout of every token span just recoloured).
  function drawMatrix(canvas, matrix, diverging, sqrt, highlightRow, holder) {
    var css = holder.css || 520;
    var ratio = window.devicePixelRatio || 1;
    var size = Math.round(css * ratio);
    if (canvas.width !== size) { canvas.width = size; canvas.height = size; }
    var ctx = canvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, size, size);
    holder.matrix = matrix;
    if (!matrix) return;
    var labels = n <= 48;
    ctx.font = Math.round(11 * ratio) + "px system-ui, sans-serif";
    var margin = 0;
    if (labels) {
      for (var t = 0; t < n; t++) margin = Math.max(margin, ctx.measureText(shortLabel(t)).width);
      margin = Math.min(margin + 6 * ratio, size * 0.22);
    }
    holder.margin = margin / size;
    var vmax = 0, i;
    for (i = 0; i < matrix.length; i++) vmax = Math.max(vmax, Math.abs(matrix[i]));
    if (!(vmax > 0)) vmax = 1;
    var image = new ImageData(n, n), pixels = new Uint32Array(image.data.buffer);
    var table = diverging ? DIVERGING : SEQUENTIAL, inverse = 1 / vmax, level;
    for (i = 0; i < matrix.length; i++) {
      var v = matrix[i] * inverse;
      if (diverging) level = Math.round((v + 1) * 127.5);
      else level = v > 0 ? Math.round((sqrt ? Math.sqrt(v) : v) * 255) : 0;
      pixels[i] = table[level < 0 ? 0 : level > 255 ? 255 : level];
    }
    if (!holder.pixels) {  // an n × n canvas of the matrix's pixels, scaled onto the visible one
      holder.pixels = document.createElement("canvas");
      holder.pixels.width = n; holder.pixels.height = n;
    }
    holder.pixels.getContext("2d").putImageData(image, 0, 0);
    var cell = (size - margin) / n;
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(holder.pixels, margin, margin, size - margin, size - margin);
    if (labels) {
      ctx.fillStyle = "#333";
      ctx.textBaseline = "middle";
      for (var k = 0; k < n; k++) {
        ctx.textAlign = "right";
        ctx.fillText(shortLabel(k), margin - 4 * ratio, margin + (k + 0.5) * cell);
        ctx.save();
        ctx.translate(margin + (k + 0.5) * cell, margin - 4 * ratio);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(shortLabel(k), 0, 0);
        ctx.restore();
      }
    }
    if (highlightRow !== null && highlightRow !== undefined) {
      ctx.strokeStyle = "#1f4e99";
      ctx.lineWidth = Math.max(1.5 * ratio, 1);
      ctx.strokeRect(margin, margin + highlightRow * cell, size - margin, Math.max(cell, 1));
    }
    holder.vmax = vmax;
  }

  function shortLabel(k) {
    var label = meta.display[k];
    return label.length > 14 ? label.slice(0, 13) + "…" : label;
  }

  // Cell under the mouse: [query, key] or null.
  function cellAt(canvas, holder, event) {
    if (!holder.matrix) return null;
    var box = canvas.getBoundingClientRect();
    var x = (event.clientX - box.left) / box.width, y = (event.clientY - box.top) / box.height;
    var m = holder.margin;
    if (x < m || y < m) return null;
    var j = Math.floor((x - m) / (1 - m) * n), i = Math.floor((y - m) / (1 - m) * n);
    return i >= 0 && i < n && j >= 0 && j < n ? [i, j] : null;
  }

  // ----- similarity -----------------------------------------------------------------------------
  // The similarity shown: the layer's mean over heads, or the selected head's.
  function similaritySource() {
    if (!meta.similarity) return null;
    if (state.head < 0) return { ref: meta.similarity.mean, index: state.layer };
    return { ref: meta.similarity.heads, index: state.layer * meta.n_heads + state.head };
  }

  function similarityMatrix() {
    var source = similaritySource();
    if (!source) return null;
    var upper = read(source.ref, source.index);
    var full = new Float32Array(n * n), index = 0;
    for (var i = 0; i < n; i++) {
      for (var j = i + 1; j < n; j++) {
        var v = upper[index++];
        full[i * n + j] = v;
        full[j * n + i] = v;
      }
    }
    return full;
  }

  // ----- diagnostics ----------------------------------------------------------------------------
  function renderDiagnostics() {
    var m = method(), box = $("diagnostics");
    box.textContent = "";
    var thresholds = meta.thresholds;
    $("diagnostics-help").textContent =
      "Row entropy of the method's matrix after each layer against its uniform maximum log n = " +
      Math.log(n).toFixed(2) + " nats" + (meta.causal ? " (log(i + 1) for causal row i)" : "") +
      "; share of each row's mass on special tokens; the token holding the largest mean mass. " +
      "Flags: diffuse when entropy ≥ " + Math.round(thresholds.diffusion * 100) + " % of the maximum, " +
      "collapsed when one token holds ≥ " + Math.round(thresholds.collapse * 100) + " % of the mass. Click a row to show that layer.";
    if (!m.diagnostics) {
      $("diagnostics-caption").textContent = "";
      var p = document.createElement("p");
      p.className = "note";
      p.textContent = m.matrices ? (m.note || "no diagnostics for this method") : "no matrix for this method, so no row diagnostics";
      box.appendChild(p);
      return;
    }
    var head = headShown(m);
    var d = head >= 0 ? m.diagnostics.heads : m.diagnostics.fused;
    var pick = function (field, v) { return head >= 0 ? d[field][v][head] : d[field][v]; };
    $("diagnostics-caption").textContent = m.name + ", " + (head >= 0 ? "head " + head : "heads fused");
    var wrap = document.createElement("div");
    wrap.className = "diag-box";
    var table = document.createElement("table");
    table.className = "diag";
    var header = table.createTHead().insertRow();
    ["layer", "row entropy / max", "special", "top token", "flags"].forEach(function (title) {
      var th = document.createElement("th"); th.textContent = title; header.appendChild(th);
    });
    var body = table.createTBody(), views = m.matrices.shape[0], current = viewIndex(m);
    for (var v = 0; v < views; v++) {
      var tr = body.insertRow();
      var layer = m.first_layer === null ? null : m.first_layer + v;
      tr.dataset.view = String(v);
      if (v === current) tr.className = "current";
      cell(tr, layer === null ? "final" : layerLabel(layer));
      var entropyCell = tr.insertCell(), normalized = pick("normalized_entropy", v);
      var frame = document.createElement("span"); frame.className = "bar-box";
      var bar = document.createElement("span"); bar.className = "bar"; bar.style.width = Math.round(normalized * 70) + "px";
      bar.style.marginRight = "0";
      frame.appendChild(bar);
      entropyCell.appendChild(frame);
      entropyCell.appendChild(document.createTextNode(
        pick("entropy", v).toFixed(2) + " / " + pick("max_entropy", v).toFixed(2) + " (" + Math.round(normalized * 100) + " %)"));
      cell(tr, Math.round(pick("special_share", v) * 100) + " %", "num");
      var top = pick("top_token", v);
      cell(tr, "'" + meta.display[top] + "' " + Math.round(pick("top_share", v) * 100) + " %");
      var flags = tr.insertCell();
      if (pick("diffuse", v)) badge(flags, "diffuse", "diffuse");
      if (pick("collapsed", v)) badge(flags, "collapsed", "collapsed");
      if (!pick("diffuse", v) && !pick("collapsed", v)) badge(flags, "ok", "ok");
      if (layer !== null) tr.addEventListener("click", onDiagnosticsRow);
    }
    wrap.appendChild(table);
    box.appendChild(wrap);
  }
  function cell(tr, text, cls) { var td = tr.insertCell(); td.textContent = text; if (cls) td.className = cls; return td; }
  function badge(td, cls, text) { var s = document.createElement("span"); s.className = "flag " + cls; s.textContent = text; td.appendChild(s); }
  function onDiagnosticsRow(event) {
    var m = method();
    state.layer = m.first_layer + Number(event.currentTarget.dataset.view);
    $("layer").value = String(state.layer);
    render();
  }

  // ----- selectors ------------------------------------------------------------------------------
  function option(select, value, text) {
    var o = document.createElement("option"); o.value = value; o.textContent = text; select.appendChild(o); return o;
  }

  function fillSelectors() {
    var methodSelect = $("method");
    meta.methods.forEach(function (m, index) {
      var o = option(methodSelect, String(index), m.name + (m.matrices ? "" : " (scores only)") + (meta.opened_why && m.name === meta.opens_on ? " · auto's choice" : ""));
      o.title = m.description;
    });
    var layerSelect = $("layer");
    for (var l = 0; l < meta.n_layers; l++) option(layerSelect, String(l), layerLabel(l) + (l === meta.n_layers - 1 ? " (last)" : ""));
    var headSelect = $("head");
    option(headSelect, "-1", "fused");
    for (var h = 0; h < meta.n_heads; h++) option(headSelect, String(h), "head " + h);
    fillRowSelect();
    methodSelect.value = String(state.method);
    layerSelect.value = String(state.layer);
    headSelect.value = String(state.head);
    methodSelect.addEventListener("change", function () { state.method = Number(methodSelect.value); render(); });
    layerSelect.addEventListener("change", function () { state.layer = Number(layerSelect.value); render(); });
    headSelect.addEventListener("change", function () { state.head = Number(headSelect.value); render(); });
    $("row").addEventListener("change", function () {
      var value = $("row").value;
      state.row = /^\d+$/.test(value) ? Number(value) : value;
      renderRow();
    });
    $("scale").addEventListener("change", function () { state.scale = $("scale").value; render(); });
  }

  function fillRowSelect() {
    var select = $("row");
    select.textContent = "";
    option(select, "mean", "mean of rows");
    option(select, "cls", "first (" + meta.display[0] + ")");
    option(select, "last", "last (" + meta.display[n - 1] + ")");
    if (typeof state.row === "number") option(select, String(state.row), "token #" + state.row + " '" + meta.display[state.row] + "'");
    select.value = String(state.row);
  }

  // ----- rendering ------------------------------------------------------------------------------
  var current = { matrix: null };

  // A render inflates the chunks it needs first (asynchronously, unless they are cached), then
  // draws; a newer render supersedes one still waiting. body[data-busy] is "1" until it has drawn.
  var renderSerial = 0;

  function render() {
    document.body.dataset.busy = "1";
    show(performance.now(), ++renderSerial);
  }

  function neededChunks() {
    var needed = [], source = matrixSource();
    if (source) needed.push(source);
    if (meta.similarity) needed.push(similaritySource());
    return needed;
  }

  function show(started, serial) {
    if (serial !== renderSerial) return;
    var needed = neededChunks();
    if (needed.every(function (c) { return cached(c.ref.chunks[c.index]); })) { draw(started); return; }
    Promise.all(needed.map(function (c) { return load(c.ref, c.index); })).then(
      function () { show(started, serial); }, failed);
  }

  function failed(error) {
    var empty = $("matrix-empty");
    empty.hidden = false;
    empty.textContent = "could not decode the page's data (" + error + "); the explorer needs a browser with " +
      "DecompressionStream: Chrome or Edge 80, Firefox 113, Safari 16.4 or later";
    document.body.dataset.busy = "0";
    throw error;
  }

  function draw(started) {
    matrixState.css = $("matrix").getBoundingClientRect().width;
    similarityState.css = $("similarity").getBoundingClientRect().width;
    var m = method(), view = viewIndex(m), head = headShown(m);
    current.matrix = currentMatrix();
    $("row").disabled = !m.matrices;
    $("head").title = m.heads ? "" : "this method has no per-head matrices: its heads are fused";
    var notes = [];
    if (m.matrices && m.first_layer === null) notes.push(m.name + " gives its final matrix only (the layer selector applies to the similarity panel).");
    if (m.matrices && view < 0) notes.push(m.name + " starts at layer " + layerLabel(m.first_layer) + ".");
    if (state.head >= 0 && !m.heads) notes.push(m.name + " has no per-head matrices: heads fused.");
    if (m.note) notes.push(m.note);
    $("method-note").textContent = m.description + (notes.length ? " — " + notes.join(" ") : "");
    var summaries = m.summaries || {}, sentence = "";
    if (!m.matrices) sentence = summaries.fused[0];
    else if (view >= 0) sentence = head >= 0 && summaries.heads ? summaries.heads[view][head] : summaries.fused[view];
    $("summary").textContent = sentence ? sentence + (m.matrices ? " — default row; hover or click a token to see its row" : "") : "";
    $("faithfulness").hidden = !m.faithfulness;
    $("faithfulness").textContent = m.faithfulness ? "faithfulness on this input (default row): " + m.faithfulness : "";

    var empty = $("matrix-empty");
    if (!m.matrices) { empty.hidden = false; empty.textContent = "no matrix for this method (attribution only: one score per token)"; }
    else if (view < 0) { empty.hidden = false; empty.textContent = "no matrix for layer " + layerLabel(state.layer); }
    else empty.hidden = true;

    var similarity = similarityMatrix();
    drawMatrix($("similarity"), similarity, true, false, null, similarityState);
    $("similarity-empty").hidden = !!similarity;
    $("similarity-empty").textContent = "no head outputs in the trace, so no context similarity";
    $("similarity-caption").textContent = similarity
      ? "layer " + layerLabel(state.layer) + ", " + (state.head >= 0 ? "head " + state.head : "mean over heads") +
        " · |S| ≤ " + formatValue(similarityState.vmax)
      : "";
    renderRow();
    renderDiagnostics();
    var elapsed = performance.now() - started;
    document.body.dataset.renderMs = elapsed.toFixed(1);
    $("timing").textContent = "drawn in " + elapsed.toFixed(0) + " ms";
    document.body.dataset.busy = "0";
    document.body.dataset.ready = "1";
    document.dispatchEvent(new CustomEvent("attnflow-drawn", { detail: elapsed }));
  }

  // Token colours, the matrix with its row outlined, and the row text: for the hovered or chosen row.
  function renderRow() {
    var m = method(), shownRow = state.hover !== null ? state.hover : state.row, scores;
    if (!m.matrices) {
      scores = Float32Array.from(m.scores);
      $("tokens-caption").textContent = "coloured by " + m.name + " scores";
      $("row-info").textContent = "attribution-only method: one score per token, no rows to show.";
    } else if (current.matrix) {
      scores = rowScores(current.matrix, shownRow);
      $("tokens-caption").textContent = "coloured by " + rowLabel(shownRow);
      $("row-info").textContent = describeRow(scores, shownRow);
    } else {
      scores = new Float32Array(n);
      $("tokens-caption").textContent = "";
      $("row-info").textContent = "";
    }
    var vmax = colourTokens(scores);
    $("scale-bar").classList.toggle("signed", !!m.signed);
    $("legend-min").textContent = m.signed ? formatValue(-vmax) : "0";
    $("legend-text").textContent = m.signed
      ? "signed scores: orange supports the target, blue speaks against it (scaled to the largest |score| of a non-special token)"
      : "colour ∝ score, scaled to the largest non-special token (" + formatValue(vmax) + "); blue: negative";
    for (var i = 0; i < n; i++) {
      tokenSpans[i].classList.toggle("shown", state.hover === i);
      tokenSpans[i].classList.toggle("pinned", state.row === i);
    }
    var highlight = typeof shownRow === "number" ? shownRow : shownRow === "cls" ? 0 : shownRow === "last" ? n - 1 : null;
    drawMatrix($("matrix"), current.matrix, false, state.scale === "sqrt", highlight, matrixState);
  }

  function describeRow(scores, row) {
    var order = Array.from(scores.keys()).sort(function (a, b) { return scores[b] - scores[a]; }).slice(0, 5);
    var parts = order.map(function (j) { return "'" + meta.display[j] + "' " + formatValue(scores[j]); });
    return (typeof row === "number" ? "Row " + row + " ('" + meta.display[row] + "') draws most on: " : rowLabel(row) + ": ") + parts.join(", ");
  }

  function onCanvasMove(canvas, holder, readout, word) {
    return function (event) {
      var at = cellAt(canvas, holder, event);
      if (!at) { readout.textContent = word.idle; return; }
      var i = at[0], j = at[1];
      readout.textContent = word.name + " #" + i + " '" + meta.display[i] + "' → #" + j + " '" + meta.display[j] + "': " +
        formatValue(holder.matrix[i * n + j]);
    };
  }

  function init() {
    buildTokens();
    fillSelectors();
    var matrixCanvas = $("matrix");
    matrixCanvas.addEventListener("mousemove", onCanvasMove(matrixCanvas, matrixState, $("matrix-readout"),
      { name: "query", idle: "hover the matrix: query → key; click a cell to show its row" }));
    matrixCanvas.addEventListener("click", function (event) {
      var at = cellAt(matrixCanvas, matrixState, event);
      if (at) pinRow(at[0]);
    });
    var similarityCanvas = $("similarity");
    similarityCanvas.addEventListener("mousemove", onCanvasMove(similarityCanvas, similarityState, $("similarity-readout"),
      { name: "S", idle: "S = Z Zᵀ of the head's outputs (dot products, diagonal 0); blue negative, red positive" }));
    var skipped = Object.keys(meta.skipped || {});
    $("skipped").textContent = skipped.length
      ? "Not shown: " + skipped.map(function (name) { return name + " (" + meta.skipped[name] + ")"; }).join("; ")
      : "";
    window.addEventListener("resize", function () { render(); });
    render();
  }

  // For tests and scripts: the decoded values of chunk `index` of a data reference in `meta`
  // (e.g. attnflowExplorer.values(attnflowExplorer.meta.methods[0].heads, 3 * meta.n_heads + 2):
  // view 3, head 2).
  window.attnflowExplorer = {
    meta: meta,
    values: function (ref, index) {
      return load(ref, index).then(function () { return read(ref, index); });
    },
  };

  init();
})();
