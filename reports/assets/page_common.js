/* The interactive report page's script, part 1 of 3 (reports/html.py joins the parts in one function
   scope; part 1: the data, helpers, tooltip, sortable tables). The page: sortable tables, the simulated pipeline timeline
   (zoom, pan, hover), memory per stage and the sweep's curve, drawn as inline SVG from the JSON blob
   #report-data. Every figure comes from the cost model; here seconds become ms and bytes GiB, only
   to show them. With #selftest in the address the page clicks, zooms and hovers itself and writes the
   outcome into #report-status (tests/reports/test_html_page.py reads it from the DOM). */
  "use strict";
  var NS = "http://www.w3.org/2000/svg";   // the SVG namespace name, not an address to fetch
  var GIB = 1024 * 1024 * 1024;
  var D = JSON.parse(document.getElementById("report-data").textContent);
  var tip = document.getElementById("tooltip");
  var timeline = null;

  function $(id) { return document.getElementById(id); }
  function svgEl(tag, attrs, parent) {
    var n = document.createElementNS(NS, tag);
    Object.keys(attrs).forEach(function (k) { n.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(n);
    return n;
  }
  function text(parent, x, y, s, anchor) {
    var t = svgEl("text", {x: x, y: y, "text-anchor": anchor || "start"}, parent);
    t.textContent = s;
    return t;
  }
  function ms(s) { return (1e3 * s).toLocaleString("en", {maximumFractionDigits: 3}); }
  function gib(b) { return (b / GIB).toFixed(2); }
  function pct(f) { return (100 * f).toFixed(1) + "%"; }
  function num(v, digits) { return v === null ? "-" : v.toLocaleString("en", {maximumFractionDigits: digits}); }
  function niceStep(span, count) {
    var raw = span / count, p = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = raw / p;
    return p * (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10);
  }

  /* The tooltip: one element, filled by whatever the pointer is over (data-tip holds its text). */
  function showTip(ev, s) {
    tip.textContent = s;
    tip.hidden = false;
    tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  }
  function hoverable(svg, describe) {
    svg.addEventListener("mouseover", function (ev) {
      var s = describe(ev.target);
      if (s) { showTip(ev, s); } else { tip.hidden = true; }
    });
    svg.addEventListener("mouseleave", function () { tip.hidden = true; });
  }

  /* Sortable tables: a click on a header sorts by that column, a second click reverses. */
  function cellKey(td) {
    var raw = td.getAttribute("data-sort");
    if (raw !== null) { return parseFloat(raw); }
    var t = td.textContent.trim();
    return /^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*%?$/i.test(t) ? parseFloat(t.replace(/,/g, "")) : t.toLowerCase();
  }
  function sortTable(table, col) {
    var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
    var asc = !(table.dataset.sortCol === String(col) && table.dataset.sortDir === "asc");
    rows.sort(function (a, b) {
      var x = cellKey(a.cells[col]), y = cellKey(b.cells[col]);
      var c = typeof x !== typeof y ? (typeof x === "number" ? -1 : 1) : x < y ? -1 : x > y ? 1 : 0;
      return asc ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    table.dataset.sortCol = String(col);
    table.dataset.sortDir = asc ? "asc" : "desc";
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
      th.className = i === col ? table.dataset.sortDir : "";
    });
  }
  function makeSortable(table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.title = "sort by this column";
      th.addEventListener("click", function () { sortTable(table, col); });
    });
  }
  function fillTable(table, headers, rows) {
    var head = table.createTHead().insertRow();
    headers.forEach(function (h) { var th = document.createElement("th"); th.textContent = h; head.appendChild(th); });
    var body = table.createTBody();
    rows.forEach(function (cells) {
      var tr = body.insertRow();
      cells.forEach(function (c) {
        var td = tr.insertCell();
        td.textContent = c[0];
        if (c.length > 1) { td.setAttribute("data-sort", String(c[1])); }
      });
    });
  }

  function ranking() {
    if (!D.ranking.length) { return; }
    fillTable($("ranking"), ["#", "plan", "step s", "tokens/s", "MFU %", "peak GiB", "bubble % of step", "fits"],
      D.ranking.map(function (r) {
        return [[String(r.rank), r.rank], [r.plan], [r.step_time_s.toFixed(3), r.step_time_s],
                [num(r.tokens_per_s, 0), r.tokens_per_s], [(100 * r.mfu).toFixed(1), r.mfu],
                [gib(r.peak_memory_bytes), r.peak_memory_bytes], [(100 * r.bubble_fraction).toFixed(1), r.bubble_fraction],
                [r.fits ? "yes" : "NO"]];
      }));
  }

