// The memory explorer's script (index.html loads it, then the data files, with script tags).
// The view is the URL's hash (#layer=layer_4&sort=top1&page=0&slot=123&q=word&window=12): every click changes
// the hash and render() draws the hash, so a view can be linked, reloaded, or driven by a test.
// body[data-ready] holds the hash last drawn.
"use strict";
var cache = {}, waiting = {};
window.pkmExplorerData = function (name, data) { cache[name] = data; };

function load(name) {
  if (cache[name] !== undefined) return Promise.resolve(cache[name]);
  if (!waiting[name]) {
    waiting[name] = new Promise(function (resolve, reject) {
      var script = document.createElement("script");
      script.src = "data/" + name + ".js";
      script.onload = function () { resolve(cache[name]); };
      script.onerror = function () { reject(new Error("cannot read data/" + name + ".js")); };
      document.head.appendChild(script);
    });
  }
  return waiting[name];
}

function el(tag, attrs, children) {
  var node = document.createElement(tag);
  Object.keys(attrs || {}).forEach(function (key) {
    if (key === "text") node.textContent = attrs[key];
    else if (key === "onclick") node.onclick = attrs[key];
    else node.setAttribute(key, attrs[key]);
  });
  (children || []).forEach(function (child) {
    node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
  });
  return node;
}

function state() {
  var params = new URLSearchParams(location.hash.slice(1));
  return {
    layer: params.get("layer"), sort: params.get("sort"),
    page: Math.max(0, parseInt(params.get("page") || "0", 10) || 0),
    slot: params.has("slot") ? parseInt(params.get("slot"), 10) : null,
    q: params.get("q") || "", window: params.has("window") ? parseInt(params.get("window"), 10) : null
  };
}

function go(changes) {
  var now = state(), params = new URLSearchParams();
  Object.keys(changes).forEach(function (key) { now[key] = changes[key]; });
  ["layer", "sort", "page", "slot", "q", "window"].forEach(function (key) {
    if (now[key] !== null && now[key] !== "" && !(key === "page" && now[key] === 0)) params.set(key, now[key]);
  });
  location.hash = params.toString();
}

var PER_PAGE = 50, summary = null, tokens = null, orders = {};
var pct = function (x) { return (100 * x).toFixed(2) + " %"; };

function sortKey(layer, sort) {  // a column of the layer (product keys: top1, weight; n-grams: used, weight)
  var keys = layer.columns.map(function (c) { return c[0]; });
  return keys.indexOf(sort) >= 0 ? sort : keys[0];
}

function rankedOrder(layer, sort) {
  sort = sortKey(layer, sort);
  var key = layer.name + "/" + sort;
  if (!orders[key]) {
    var index = layer.ranked.slot.map(function (_, i) { return i; }), r = layer.ranked;
    var keys = [sort].concat(layer.columns.map(function (c) { return c[0]; }).filter(function (k) { return k !== sort; }));
    if (sort !== layer.columns[0][0]) {  // the summary is in the first column's order; else by this column, then the others, then slot
      index.sort(function (a, b) {
        for (var k = 0; k < keys.length; k++) { var d = r[keys[k]][b] - r[keys[k]][a]; if (d) return d; }
        return r.slot[a] - r.slot[b];
      });
    }
    orders[key] = index;
  }
  return orders[key];
}

function tableOf(layer, bucket) {  // the n-gram table holding a bucket (tables are consecutive row ranges)
  var tables = layer.tables;
  for (var t = tables.length - 1; t >= 0; t--) if (bucket >= tables[t].offset) return [t, tables[t]];
  return [0, tables[0]];
}

function tableLabel(table) {
  return table.order + "-gram " + table.side + " here, hash " + table.hash;
}

function slotLabel(layer, slot) {
  if (layer.kind === "product_key") return slot + " (" + Math.floor(slot / layer.n_keys) + ", " + slot % layer.n_keys + ")";
  if (layer.kind === "ngram") { var t = tableOf(layer, slot); return slot + " (table " + t[0] + ", row " + (slot - t[1].offset) + ")"; }
  return String(slot);
}

function headLabel(layer, h) {
  return layer.kind === "ngram" ? "table " + h + ": " + tableLabel(layer.tables[h]) : "head " + h;
}

function renderLayers(current) {
  var nav = document.getElementById("layers");
  nav.innerHTML = "";
  summary.layers.forEach(function (layer) {
    nav.appendChild(el("button", {
      id: "layer-" + layer.name, "class": layer.name === current.name ? "active" : "",
      text: layer.name + " (" + layer.size.toLocaleString("en") + " " + layer.unit + "s)",
      onclick: function () { go({layer: layer.name, page: 0, slot: null}); }
    }));
  });
  var input = el("input", {id: "search", type: "search", placeholder: "token or word", value: state().q});
  var form = el("form", {id: "search-form"}, [input, el("button", {id: "search-button", type: "submit", text: "Search"})]);
  form.onsubmit = function (event) { event.preventDefault(); go({q: input.value.trim(), slot: null}); };
  nav.appendChild(form);
}

function curveSvg(layer) {
  var w = 300, h = 190, left = 34, bottom = 26, ns = "http://www.w3.org/2000/svg";
  var svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", w + 130); svg.setAttribute("height", h + 8); svg.setAttribute("id", "usage-curve");
  function add(tag, attrs, text) {
    var node = document.createElementNS(ns, tag);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text) node.textContent = text;
    svg.appendChild(node); return node;
  }
  var X = function (x) { return left + x * (w - left - 6); }, Y = function (y) { return h - bottom - y * (h - bottom - 6); };
  add("rect", {x: X(0), y: Y(1), width: X(1) - X(0), height: Y(0) - Y(1), fill: "none", stroke: "#bcccdc"});
  add("line", {x1: X(0), y1: Y(0), x2: X(1), y2: Y(1), stroke: "#bcccdc", "stroke-dasharray": "3 3"});
  var ngram = layer.kind === "ngram";
  [["used", "#1f77b4", ngram ? "reads" : "selected (u)"], ["weight", "#2ca02c", ngram ? "gate (w)" : "weight (w)"],
   ["top1", "#d62728", "top-1 picks (t)"]].filter(function (c) { return layer.curve[c[0]]; }).forEach(function (c, i) {
    var points = layer.curve.x.map(function (x, j) { return X(x).toFixed(1) + "," + Y(layer.curve[c[0]][j]).toFixed(1); });
    add("polyline", {points: points.join(" "), fill: "none", stroke: c[1], "stroke-width": 1.6});
    add("line", {x1: w + 4, y1: 14 + 14 * i, x2: w + 22, y2: 14 + 14 * i, stroke: c[1], "stroke-width": 2});
    add("text", {x: w + 26, y: 18 + 14 * i}, c[2]);
  });
  add("text", {x: X(0), y: h - 8}, "0");
  add("text", {x: X(1) - 26, y: h - 8}, "100 %");
  add("text", {x: X(0.18), y: h - 8}, "most-used slots (% of all)");
  add("text", {x: 2, y: Y(1) + 8}, "100 %");
  add("text", {x: 2, y: Y(0.5)}, "share");
  return svg;
}

function renderLayer(layer, s) {
  var view = document.getElementById("layer-view"), m = layer.metrics, unit = layer.unit;
  view.innerHTML = "";
  var ngram = layer.kind === "ngram", selected = ngram ? "read" : "selected";
  view.appendChild(el("h2", {text: layer.name + ": " + layer.size.toLocaleString("en") + " " + unit + "s, " +
    (ngram ? "hashed n-gram memory, " + layer.tables.length + " tables" :
     layer.kind.replace("_", " ") + " memory" + (layer.heads ? ", " + layer.heads + " heads x top-" + layer.knn : ""))}));
  var fixed = function (key) { return m[key] === undefined ? null : m[key].toFixed(4); };
  var rows = [
    ["tokens", "tokens", String(m.tokens)], ["mu", "MU (" + selected + " at least once)", pct(m.mu)],
    ["top1_mu", "top-1 MU (some token's top-1 pick)", m.top1_mu === undefined ? null : pct(m.top1_mu)],
    ["never_picked", unit + "s never picked (top-1)", layer.never_picked === null ? null : layer.never_picked + " (" + pct(layer.never_picked / layer.size) + ")"],
    ["never_selected", unit + "s never " + selected, layer.never_selected + " (" + pct(layer.never_selected / layer.size) + ")"],
    ["kl_u", "KL_u (nats)", fixed("kl_u")], ["kl_w", "KL_w (nats)", fixed("kl_w")],
    ["gini_u", "Gini_u", fixed("gini_u")], ["gini_w", "Gini_w", fixed("gini_w")],
    ["top50_w", unit + "s holding 50 % of the weight", m.top50_w === undefined ? null : String(m.top50_w)],
    ["top90_w", unit + "s holding 90 % of the weight", m.top90_w === undefined ? null : String(m.top90_w)],
    ["top50_u", unit + "s holding 50 % of the reads", ngram ? String(m.top50_u) : null],
    ["top90_u", unit + "s holding 90 % of the reads", ngram ? String(m.top90_u) : null]
  ].filter(function (r) { return r[2] !== null; });
  var table = el("table", {id: "metrics"}, rows.map(function (r) {
    return el("tr", {"data-metric": r[0]}, [el("th", {text: r[1]}), el("td", {text: r[2]})]);
  }));
  view.appendChild(el("div", {style: "display:flex;gap:12px;flex-wrap:wrap"}, [el("div", {style: "flex:1;min-width:250px"}, [table]), curveSvg(layer)]));

  var sort = sortKey(layer, s.sort), order = rankedOrder(layer, sort), r = layer.ranked;
  var pages = Math.max(1, Math.ceil(order.length / PER_PAGE)), label = {};
  layer.columns.forEach(function (c) { label[c[0]] = c[1]; });
  var page = Math.min(s.page, pages - 1);
  var goto = el("input", {id: "goto-slot", type: "number", min: 0, max: layer.size - 1, style: "width:90px", placeholder: unit + " #"});
  goto.onkeydown = function (event) { if (event.key === "Enter" && goto.value !== "") go({slot: parseInt(goto.value, 10)}); };
  view.appendChild(el("h3", {text: unit[0].toUpperCase() + unit.slice(1) + "s ranked by " + label[sort] +
    " (" + order.length.toLocaleString("en") + " " + selected + " at least once; the " + layer.never_selected.toLocaleString("en") + " never " + selected + " are not listed)"}));
  view.appendChild(el("div", {"class": "pager"}, [
    el("button", {id: "prev-page", text: "\u2190 previous", onclick: function () { go({page: Math.max(0, page - 1)}); }}),
    el("span", {id: "page-label", text: "page " + (page + 1) + " of " + pages}),
    el("button", {id: "next-page", text: "next \u2192", onclick: function () { go({page: Math.min(pages - 1, page + 1)}); }}),
  ].concat(layer.columns.slice(0, 2).map(function (c) {
    return el("button", {id: "sort-" + c[0], text: "by " + c[1], onclick: function () { go({sort: c[0], page: 0}); }});
  })).concat([goto])));
  var where = ngram ? " (table, row)" : " (i1, i2)";
  var head = el("tr", {}, ["rank", unit + where].concat(layer.columns.map(function (c) { return c[1]; })).map(function (t) { return el("th", {text: t}); }));
  var body = order.slice(page * PER_PAGE, (page + 1) * PER_PAGE).map(function (i, k) {
    return el("tr", {"data-slot": r.slot[i], "class": r.slot[i] === s.slot ? "open" : "",
                     onclick: function () { go({slot: r.slot[i]}); }}, [
      el("td", {text: String(page * PER_PAGE + k + 1)}), el("td", {text: slotLabel(layer, r.slot[i])})
    ].concat(layer.columns.map(function (c) {
      return el("td", {"data-field": c[0], text: c[0] === "weight" ? r.weight[i].toFixed(3) : String(r[c[0]][i])});
    })));
  });
  view.appendChild(el("table", {id: "slot-table"}, [head].concat(body)));
}

function words(text) { return text.replace(/ ##/g, ""); }

function contextLine(position, windowSize, first, last) {  // [first, last]: the highlighted tokens (default: position)
  first = first === undefined ? position : first; last = last === undefined ? position : last;
  var length = summary.sequence_length, start = position - position % length;
  var from = Math.max(start, first - windowSize), to = Math.min(start + length, last + windowSize + 1);
  var before = tokens.slice(from, first).join(" "), after = tokens.slice(last + 1, to).join(" ");
  var centre = tokens.slice(first, last + 1).join(" ");
  var span = el("span", {"class": "context"}, [
    (from > start ? "\u2026 " : "") + words(before).replace(/^##/, "") + (centre.indexOf("##") === 0 ? "" : " "),
    el("mark", {text: words(centre).replace(/^##/, "")}),
    words(" " + after).replace(/^ ##/, "") + (to < start + length ? " \u2026" : "")
  ]);
  return span;
}

function renderSlot(layer, s) {
  var view = document.getElementById("detail-view"), unit = layer.unit, slot = s.slot;
  if (!(slot >= 0 && slot < layer.size)) {
    view.innerHTML = "";
    view.appendChild(el("p", {"class": "error", text: unit + " " + slot + " does not exist: " + layer.name + " has " + layer.size + " " + unit + "s (0 to " + (layer.size - 1) + ")"}));
    return Promise.resolve();
  }
  var chunk = Math.floor(slot / summary.chunk_size), present = layer.chunks.indexOf(chunk) >= 0;
  var name = layer.name + "/slots_" + String(chunk).padStart(5, "0");
  return (present ? load(name) : Promise.resolve({contexts: {}, promoted: {}})).then(function (data) {
    var i = layer.ranked.slot.indexOf(slot), r = layer.ranked;
    var contexts = data.contexts[String(slot)] || [], promoted = data.promoted[String(slot)];
    var windowSize = s.window !== null && s.window >= 0 ? s.window : summary.window;
    view.innerHTML = "";
    view.appendChild(el("h2", {id: "slot-title", text: layer.name + ", " + unit + " " + slotLabel(layer, slot)}));
    var first = layer.columns[0];
    view.appendChild(el("p", {id: "slot-counts", text: i < 0 ? "never " + (layer.kind === "ngram" ? "read" : "selected") + " by these " + summary.tokens + " tokens" :
      layer.columns.map(function (c) { return (c[0] === "weight" ? r.weight[i].toFixed(3) : r[c[0]][i]) + " " + c[1]; }).join(", ") +
      " (rank " + (rankedOrder(layer, first[0]).indexOf(i) + 1) + " by " + first[1] + ")" +
      (layer.kind === "ngram" ? "; " + tableLabel(tableOf(layer, slot)[1]) : "")}));
    view.appendChild(el("h3", {text: "Tokens its value promotes"}));
    var p = layer.projection;
    view.appendChild(el("p", {"class": "muted", text: p.formula + "; E = " + p.E + (p.gamma ? ", gamma = " + p.gamma : "") +
      (p.exact ? "" : " (approximate: " + p.note + ")")}));
    view.appendChild(promoted ? el("div", {id: "promoted", "class": "tokens"}, promoted.map(function (t) {
      return el("span", {"data-token": t[0]}, [t[0], el("small", {text: t[1].toFixed(2)})]);
    })) : el("p", {id: "promoted", "class": "muted", text: "not projected (--max_projected_slots)"}));
    view.appendChild(el("h3", {text: layer.kind === "ngram" ?
      "Contexts that read it (the n-gram highlighted; the " + summary.contexts_per_slot + " with the largest gate g, shown)" :
      "Contexts that selected it (heaviest " + summary.contexts_per_slot + "; weight w(x) of the " + unit + ", \u2605 = the token's top-1 pick)"}));
    if (!contexts.length) view.appendChild(el("p", {"class": "muted", id: "contexts", text: "no context selected it"}));
    else view.appendChild(el("ol", {id: "contexts", "class": "contexts"}, contexts.map(function (c) {
      return el("li", {"data-position": c[0], "data-weight": c[1]}, [
        el("span", {"class": "w", text: c[1].toFixed(3)}), c[2] ? el("span", {"class": "top1", text: "\u2605"}) : "",
        contextLine(c[0], windowSize, c[3], c[4])
      ]);
    })));
    var collided = data.collisions && data.collisions[String(slot)];
    if (collided) {  // hashed memories: the distinct n-grams that share the bucket
      view.appendChild(el("h3", {text: "Collisions: the " + collided.distinct + " distinct n-gram" + (collided.distinct === 1 ? "" : "s") +
        " hashed to this " + unit + " (\u2205 = beyond the sequence's edge)"}));
      view.appendChild(el("div", {id: "collisions", "class": "tokens"}, collided.ngrams.map(function (g) {
        return el("span", {"data-ngram": g[0], "data-count": g[1]}, [g[0], el("small", {text: "\u00d7" + g[1]})]);
      })));
    }
  });
}

function occurrences(query) {  // tokens equal to the query (## left out), and every piece of a word spelling it
  var q = query.toLowerCase(), found = {}, word = [], text = "";
  function flush() { if (word.length > 1 && text === q) word.forEach(function (i) { found[i] = true; }); }
  tokens.forEach(function (t, i) {
    var piece = t.indexOf("##") === 0, bare = (piece ? t.slice(2) : t).toLowerCase();
    if (!piece) { flush(); word = []; text = ""; }
    word.push(i); text += bare;
    if (bare === q) found[i] = true;
  });
  flush();
  return Object.keys(found).map(Number).sort(function (a, b) { return a - b; });
}

function counted(values) {
  var counts = {};
  values.forEach(function (v) { if (v >= 0) counts[v] = (counts[v] || 0) + 1; });
  return Object.keys(counts).map(function (k) { return [parseInt(k, 10), counts[k]]; })
    .sort(function (a, b) { return b[1] - a[1] || a[0] - b[0]; });
}

function slotLinks(layer, pairs, limit) {
  return el("span", {"class": "links"}, pairs.slice(0, limit).map(function (p) {
    return el("a", {href: "#", "data-slot": p[0], "data-count": p[1], onclick: function (event) {
      event.preventDefault(); go({layer: layer.name, slot: p[0], page: 0});
    }}, [slotLabel(layer, p[0]), el("small", {text: "\u00d7" + p[1]})]);
  }));
}

function renderSearch(s) {
  var view = document.getElementById("detail-view");
  var positions = occurrences(s.q);
  return Promise.all(summary.layers.map(function (layer) { return load(layer.name + "/selections"); })).then(function (all) {
    view.innerHTML = "";
    view.appendChild(el("h2", {id: "search-title", text: "\u201c" + s.q + "\u201d: " + positions.length + " token occurrence" + (positions.length === 1 ? "" : "s")}));
    if (!positions.length) { view.appendChild(el("p", {"class": "muted", text: "not in the text (tokens are matched without ##, words are whole words)"})); return; }
    view.appendChild(el("p", {"class": "muted"}, ["e.g. ", contextLine(positions[0], summary.window)]));
    summary.layers.forEach(function (layer, k) {
      var sel = all[k];
      var block = el("div", {"class": "search-layer", "data-layer": layer.name});
      if (sel.top1) {
        block.appendChild(el("h3", {text: layer.name + ": top-1 " + layer.unit + "s of the occurrences"}));
        var top = counted(positions.map(function (p) { return sel.top1[p]; }));
        block.appendChild(el("p", {"data-head": "top1"}, [slotLinks(layer, top, 12), top.length > 12 ? "\u2026 (" + top.length + " in all)" : ""]));
      } else {
        block.appendChild(el("h3", {text: layer.name + ": the " + layer.unit + "s the occurrences read"}));
      }
      var rows = sel.head_top1.map(function (head, h) {
        var pairs = counted(positions.map(function (p) { return head[p]; }));
        return el("tr", {"data-head": String(h)}, [el("td", {text: headLabel(layer, h)}), el("td", {style: "text-align:left"}, [slotLinks(layer, pairs, 8)])]);
      });
      var what = layer.kind === "ngram" ? "its " + layer.unit + " \u00d7 occurrences" : "its best " + layer.unit + " \u00d7 occurrences";
      block.appendChild(el("table", {"class": "heads"}, [el("tr", {}, [el("th", {text: layer.kind === "ngram" ? "table" : "head"}), el("th", {style: "text-align:left", text: what})])].concat(rows)));
      view.appendChild(block);
    });
  });
}

function render() {
  var s = state(), hash = location.hash;
  document.body.removeAttribute("data-ready");
  var layer = summary.layers.filter(function (l) { return l.name === s.layer; })[0];
  var problem = null;
  if (!layer) {
    if (s.layer !== null) problem = "no memory layer " + s.layer + " (the layers: " + summary.layers.map(function (l) { return l.name; }).join(", ") + ")";
    layer = summary.layers[0];
  }
  renderLayers(layer);
  renderLayer(layer, s);
  if (problem) document.getElementById("layer-view").insertBefore(el("p", {"class": "error", id: "error", text: problem}), document.getElementById("layer-view").firstChild);
  var detail = s.slot !== null ? renderSlot(layer, s) : s.q ? renderSearch(s) : Promise.resolve();
  return detail.catch(function (error) {
    document.getElementById("detail-view").appendChild(el("p", {"class": "error", text: String(error)}));
  }).then(function () { document.body.setAttribute("data-ready", hash || "#"); });
}

load("explorer").then(function (data) {
  summary = data;
  document.getElementById("subtitle").textContent = summary.tokens.toLocaleString("en") + " tokens (" + summary.sequences +
    " sequences of " + summary.sequence_length + "), " + summary.layers.length + " memory layer" + (summary.layers.length === 1 ? "" : "s");
  return load("tokens");
}).then(function (data) {
  tokens = data.tokens;
  window.addEventListener("hashchange", render);
  return render();
}).catch(function (error) {
  document.getElementById("subtitle").textContent = String(error);
  document.body.setAttribute("data-ready", "error");
});
