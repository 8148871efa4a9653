// attnflow routes: draws the route that attnflow.viz.routes embeds, positions × layers.
// Every token string reaches the page through textContent, never as HTML; the page makes no request.
(function () {
  "use strict";

  var meta = JSON.parse(document.getElementById("attnflow-meta").textContent);
  var $ = function (id) { return document.getElementById(id); };
  var SVG = "http://www.w3.org/2000/svg";
  var n = meta.tokens.length, L = meta.n_layers;
  var LEFT = 44, TOP = 14, BOTTOM = 96, ROW = L > 16 ? 11 : 22;
  var COL = Math.max(30, Math.min(110, (($("graph").parentNode.clientWidth || 900) - LEFT - 16) / n));  // fits, or scrolls
  var KINDS = { attention: "attention", attention_residual: "attention residual", ffn: "feed-forward",
                ffn_residual: "feed-forward residual" };
  var lens = {};
  meta.lens.forEach(function (entry) { lens[key(entry.node)] = entry; });
  var picked = null;

  function key(node) { return node[0] + ":" + node[1] + ":" + node[2]; }
  function x(position) { return LEFT + COL * (position + 0.5); }
  function y(stream, layer) { return TOP + (2 * L - 2 * layer - (stream === "mid" ? 1 : 0)) * ROW; }

  function svg(name, attributes, parent) {
    var element = document.createElementNS(SVG, name);
    Object.keys(attributes).forEach(function (name) { element.setAttribute(name, String(attributes[name])); });
    if (parent) parent.appendChild(element);
    return element;
  }

  function add(parent, tag, text, className) {
    var element = document.createElement(tag);
    if (text !== undefined && text !== null) element.textContent = text;
    if (className) element.className = className;
    parent.appendChild(element);
    return element;
  }

  function format(value) {
    if (value === null || value === undefined) return "–";
    if (Number.isInteger(value)) return String(value);
    var magnitude = Math.abs(value);
    return magnitude === 0 || magnitude >= 0.001 ? value.toFixed(3) : value.toExponential(2);
  }

  function token(position) { return "'" + meta.display[position] + "' (" + position + ")"; }

  function streamName(stream, layer) {
    if (stream === "mid") return "after layer " + layer + "'s attention block";
    if (layer === 0) return "entering layer 0 (emb: the embeddings)";
    if (layer === L) return "leaving layer " + (L - 1) + " (L" + (L - 1) + ", the final stream)";
    return "entering layer " + layer + " (leaving layer " + (layer - 1) + ", L" + (layer - 1) + ")";
  }

  // ----- the drawing -----------------------------------------------------------------------------
  function edgePath(edge) {
    var s = edge.source, t = edge.target;
    var x1 = x(s[2]), y1 = y(s[0], s[1]), x2 = x(t[2]), y2 = y(t[0], t[1]);
    if (edge.kind === "ffn") return "M" + x1 + " " + y1 + " Q" + (x1 + COL * 0.4) + " " + (y1 + y2) / 2 + " " + x2 + " " + y2;
    if (edge.kind === "attention" && s[2] === t[2]) {
      return "M" + x1 + " " + y1 + " Q" + (x1 - COL * 0.4) + " " + (y1 + y2) / 2 + " " + x2 + " " + y2;
    }
    return "M" + x1 + " " + y1 + " L" + x2 + " " + y2;
  }

  function draw() {
    var graph = $("graph");
    var width = LEFT + COL * n + 12, height = TOP + 2 * L * ROW + BOTTOM;
    graph.setAttribute("width", width);
    graph.setAttribute("height", height);
    graph.setAttribute("viewBox", "0 0 " + width + " " + height);
    for (var position = 0; position < n; position++) {
      svg("line", { x1: x(position), x2: x(position), y1: y("in", L), y2: y("in", 0), stroke: "#f0f0f0" }, graph);
      var label = svg("text", { x: x(position), y: y("in", 0) + 14, "text-anchor": "end",
                                transform: "rotate(-40 " + x(position) + " " + (y("in", 0) + 14) + ")" }, graph);
      label.textContent = meta.display[position];
      label.setAttribute("class", position === meta.position ? "token top" : "token");
    }
    for (var layer = 0; layer <= L; layer++) {
      var row = svg("text", { x: LEFT - 6, y: y("in", layer) + 3, "text-anchor": "end", "class": "row" }, graph);
      row.textContent = layer === 0 ? "emb" : "L" + (layer - 1);
    }
    var edges = svg("g", { id: "edges" }, graph);
    for (var index = meta.route.edges.length - 1; index >= 0; index--) drawEdge(edges, index);  // the strongest on top
    var nodes = svg("g", { id: "nodes" }, graph);
    meta.route.nodes.forEach(function (entry, index) { drawNode(nodes, entry, index); });
  }

  function drawEdge(parent, index) {
    var edge = meta.route.edges[index];
    var path = svg("path", { d: edgePath(edge), "class": "edge " + edge.kind, "stroke-width": 0.6 + 7 * edge.weight,
                             "stroke-opacity": 0.75, "data-index": index, "data-reach": edge.reach }, parent);
    svg("title", {}, path).textContent = "L" + edge.layer + " " + KINDS[edge.kind] + ": weight " + format(edge.weight);
    path.addEventListener("click", function () { showEdge(index, path); });
  }

  function drawNode(parent, entry, index) {
    var node = entry.node, shade = Math.round(235 - 215 * Math.sqrt(Math.min(1, entry.importance)));
    var circle = svg("circle", { cx: x(node[2]), cy: y(node[0], node[1]), r: node[0] === "in" ? 4 : 3,
                                 fill: "rgb(" + shade + "," + shade + "," + shade + ")", "class": "node",
                                 "data-index": index, "data-reach": entry.reach }, parent);
    svg("title", {}, circle).textContent = token(node[2]) + ", the stream " + streamName(node[0], node[1]);
    circle.addEventListener("click", function () { showNode(index, circle); });
  }

  // ----- the threshold slider: the route at any τ' ≥ τ is what has reach > τ' ---------------------
  function apply(threshold) {
    var shown = { edge: 0, node: 0 };
    ["edge", "node"].forEach(function (kind) {
      $("graph").querySelectorAll("." + kind).forEach(function (element) {
        var on = Number(element.getAttribute("data-reach")) > threshold;
        element.classList.toggle("off", !on);
        if (on) shown[kind] += 1;
      });
    });
    $("graph").setAttribute("data-drawn-edges", shown.edge);
    $("graph").setAttribute("data-drawn-nodes", shown.node);
    $("threshold-value").textContent = threshold.toFixed(3);
    $("drawn").textContent = shown.edge + " edges, " + shown.node + " nodes drawn (route at threshold " +
      threshold.toFixed(3) + "; computed at " + meta.threshold + ")";
  }

  function slider() {
    var range = $("threshold"), strongest = meta.threshold;
    meta.route.edges.forEach(function (edge) { strongest = Math.max(strongest, edge.reach); });
    range.min = String(meta.threshold);
    range.max = String(Math.max(meta.threshold + 0.001, strongest));
    range.step = "0.001";
    range.value = String(meta.threshold);
    range.addEventListener("input", function () { apply(Number(range.value)); });
    apply(meta.threshold);
  }

  // ----- the panels --------------------------------------------------------------------------------
  function pick(element) {
    if (picked) picked.classList.remove("picked");
    picked = element;
    element.classList.add("picked");
  }

  function numberRow(table, label, value, id) {
    var row = table.insertRow();
    row.insertCell().textContent = label;
    var cell = row.insertCell();
    cell.className = "num";
    cell.textContent = format(value);
    if (value !== null && value !== undefined) cell.setAttribute("data-value", String(value));
    if (id) cell.id = id;
  }

  function tokenList(parent, title, tokens, valueName, id) {
    var line = add(parent, "p", title + " ", "tokenlist");
    line.id = id;
    tokens.forEach(function (entry) {
      var item = add(line, "span", entry.token, "tok");
      item.setAttribute("data-value", String(entry[valueName]));
      item.setAttribute("data-id", String(entry.id));
      add(line, "span", " " + format(entry[valueName]) + "  ");
    });
  }

  function showNode(index, element) {
    var entry = meta.route.nodes[index], node = entry.node, info = $("node-info");
    pick(element);
    info.textContent = "";
    info.setAttribute("data-node", key(node));
    add(info, "p", token(node[2]) + ", the stream " + streamName(node[0], node[1]), "heading");
    var table = add(info, "table");
    numberRow(table, "importance", entry.importance, "node-importance");
    numberRow(table, "on the route up to threshold", entry.reach, "node-reach");
    var readout = lens[key(node)];
    if (!readout) {
      add(info, "p", meta.target ? "The lens did not read this node." : "No logit lens: the model has no language-model head.", "note");
      return;
    }
    tokenList(info, "logit lens, top tokens (probability):", readout.top, "probability", "lens-top");
    [["target", meta.target], ["contrast", meta.contrast]].forEach(function (pair) {
      var name = pair[0], reading = readout[name];
      if (!reading) return;
      var lines = add(info, "table");
      lines.id = "lens-" + name;
      add(lines.insertRow().insertCell(), "span", name + " " + "'" + pair[1].token + "'", "tok");
      numberRow(lines, "rank (0 = the top token)", reading.rank, "lens-" + name + "-rank");
      numberRow(lines, "probability", reading.probability, "lens-" + name + "-probability");
      numberRow(lines, "logit", reading.logit, "lens-" + name + "-logit");
    });
  }

  function showEdge(index, element) {
    var edge = meta.route.edges[index], info = $("edge-info");
    pick(element);
    info.textContent = "";
    info.setAttribute("data-edge", String(index));
    var where = edge.kind.indexOf("attention") === 0 ? token(edge.source[2]) + " → " + token(edge.target[2]) : "at " + token(edge.target[2]);
    add(info, "p", "L" + edge.layer + " " + KINDS[edge.kind] + " " + where, "heading");
    var table = add(info, "table");
    numberRow(table, "weight (its share of the whole)", edge.weight, "edge-weight");
    numberRow(table, "importance it carries", edge.importance, "edge-importance");
    numberRow(table, "on the route up to threshold", edge.reach, "edge-reach");
    if ("effect" in edge) numberRow(table, "direct effect on the target's logit", edge.effect, "edge-effect");
    if ("contrast_effect" in edge) numberRow(table, "on the logit difference", edge.contrast_effect, "edge-contrast-effect");
    if (edge.heads) headsTable(info, edge);
    if (edge.promotes) {
      tokenList(info, "promotes:", edge.promotes, "effect", "edge-promotes");
      tokenList(info, "suppresses:", edge.suppresses, "effect", "edge-suppresses");
    } else if (meta.target && edge.kind.indexOf("residual") < 0) {
      add(info, "p", "Its promoted tokens are listed for the 1000 most important edges through blocks only.", "note");
    }
  }

  function headsTable(parent, edge) {
    var table = add(parent, "table");
    table.id = "edge-heads";
    var head = table.insertRow();
    ["head", "share", "direct effect"].forEach(function (title) { add(head, "th", title); });
    var order = edge.heads.map(function (share, h) { return h; }).filter(function (h) { return edge.heads[h] > 0; });
    order.sort(function (a, b) { return edge.heads[b] - edge.heads[a]; });
    order.forEach(function (h) {
      var row = table.insertRow();
      row.insertCell().textContent = "L" + edge.layer + ".H" + h;
      [edge.heads[h], edge.head_effects ? edge.head_effects[h] : null].forEach(function (value) {
        var cell = row.insertCell();
        cell.className = "num";
        cell.textContent = format(value);
        if (value !== null) cell.setAttribute("data-value", String(value));
      });
    });
  }

  function prediction() {
    var line = "route of position " + token(meta.position) + " (threshold " + meta.threshold + ", norm " + meta.norm + ")";
    if (meta.prediction) line += "; prediction '" + meta.prediction.token + "' (p = " + format(meta.prediction.probability) + ")";
    if (meta.target && (!meta.prediction || meta.target.id !== meta.prediction.id)) line += "; target '" + meta.target.token + "'";
    if (meta.contrastive && meta.contrast) line += "; contrastive: rather than '" + meta.contrast.token + "'";
    $("prediction").textContent = line;
  }

  prediction();
  draw();
  slider();
  window.attnflowRoutes = { meta: meta, apply: apply };
  document.body.setAttribute("data-ready", "1");
})();
