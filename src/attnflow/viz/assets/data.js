// attnflow's interactive pages (the explorer, its generation view): the decoder of the data chunks
// that attnflow.viz.explorer writes, and the number format. The page's script follows this one.
var attnflowData = (function () {
  "use strict";

  // ----- data chunks ----------------------------------------------------------------------------
  // A chunk is base64 of zlib-deflated [float32 scales][float32 exact values][int8 codes]: one scale
  // per vector along the array's last axis, a value is code × scale / 127, except in the
  // reference's exact_columns (special tokens), whose values are stored as they are. A reference
  // of shape [view, head, ...] split on 2 axes has one chunk per view and head (view × heads + head).
  // Chunks are inflated when first shown; the most recently used, up to CACHE_BYTES, are kept.
  var cache = new Map(), pending = new Map(), cachedBytes = 0;
  var CACHE_BYTES = 128 * 1024 * 1024, CODE_LEVELS = 127;

  function base64Bytes(text) {
    if (Uint8Array.fromBase64) return Uint8Array.fromBase64(text);
    var binary = atob(text), bytes = new Uint8Array(binary.length);
    for (var i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    return bytes;
  }

  function inflate(bytes) {
    var source = new ReadableStream({ start: function (controller) { controller.enqueue(bytes); controller.close(); } });
    return new Response(source.pipeThrough(new DecompressionStream("deflate"))).arrayBuffer();
  }

  function cached(id) { return cache.has(id); }

  // Promise of chunk `index` of a reference, inflated and split into {scales, exact, codes}.
  function load(ref, index) {
    var id = ref.chunks[index];
    if (cache.has(id)) return Promise.resolve(cache.get(id));
    if (!pending.has(id)) {
      var rows = ref.shape.slice(ref.split, -1).reduce(function (a, b) { return a * b; }, 1), k = ref.exact_columns.length;
      var inflated = Promise.resolve(document.getElementById(id).textContent).then(function (text) { return inflate(base64Bytes(text)); });
      pending.set(id, inflated.then(function (buffer) {
        var chunk = {
          scales: new Float32Array(buffer, 0, rows),
          exact: new Float32Array(buffer, rows * 4, rows * k),
          codes: new Int8Array(buffer, rows * 4 * (1 + k)),
        };
        pending.delete(id);
        cache.set(id, chunk);
        cachedBytes += buffer.byteLength;
        while (cachedBytes > CACHE_BYTES && cache.size > 1) {
          var oldest = cache.keys().next().value;
          cachedBytes -= cache.get(oldest).codes.buffer.byteLength;
          cache.delete(oldest);
        }
        return chunk;
      }));
    }
    return pending.get(id);
  }

  // The values of chunk `index` of a reference (loaded), as float32.
  function read(ref, index) {
    var id = ref.chunks[index], chunk = cache.get(id);
    cache.delete(id);
    cache.set(id, chunk);
    var width = ref.shape[ref.shape.length - 1], columns = ref.exact_columns, k = columns.length;
    var codes = chunk.codes, out = new Float32Array(codes.length);
    for (var row = 0; row < chunk.scales.length; row++) {
      var step = chunk.scales[row] / CODE_LEVELS, start = row * width;
      for (var i = start; i < start + width; i++) out[i] = codes[i] * step;
      for (var e = 0; e < k; e++) out[start + columns[e]] = chunk.exact[row * k + e];
    }
    return out;
  }

  function formatValue(v) {
    if (v === 0) return "0";
    var a = Math.abs(v);
    return a >= 1000 || a < 0.001 ? v.toExponential(2) : v.toPrecision(3);
  }

  return { load: load, read: read, cached: cached, formatValue: formatValue };
})();
