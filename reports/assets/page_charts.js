/* Part 2 of the page's script: the pipeline timeline, memory per stage and the sweep's curve. */
  /* The pipeline timeline: one row per rank, [t0, t1] the visible window in seconds. */
  var TL = {left: 92, right: 12, top: 22, row: 26, width: 1100};
  function Timeline(svg) {
    this.svg = svg;
    this.select(0);
    var self = this, drag = null;
    svg.addEventListener("wheel", function (ev) {
      ev.preventDefault();
      self.zoom(ev.deltaY < 0 ? 0.8 : 1.25, self.timeAt(ev));
    }, {passive: false});
    svg.addEventListener("mousedown", function (ev) { drag = {x: ev.clientX, t0: self.t0, t1: self.t1}; });
    window.addEventListener("mouseup", function () { drag = null; });
    window.addEventListener("mousemove", function (ev) {
      if (!drag) { return; }
      var scale = (drag.t1 - drag.t0) / (self.plotWidth() * svg.getBoundingClientRect().width / TL.width);
      self.show(drag.t0 - (ev.clientX - drag.x) * scale, drag.t1 - (ev.clientX - drag.x) * scale);
    });
    hoverable(svg, function (target) {
      var i = target.getAttribute("data-i");
      if (i === null) { return target.getAttribute("data-tip"); }
      var e = self.data.events[+i];
      return Object.keys(D.kinds)[e[2]] + "\nrank " + e[0] + ", stage " + e[1] + ", micro-batch " + e[3] +
        "\n" + ms(e[4]) + " to " + ms(e[5]) + " ms (" + ms(e[5] - e[4]) + " ms)";
    });
  }
  Timeline.prototype.plotWidth = function () { return TL.width - TL.left - TL.right; };
  Timeline.prototype.select = function (i) {
    this.data = D.timelines[i];
    this.t0 = 0;
    this.t1 = this.data.drawn_time_s;
    this.render();
  };
  Timeline.prototype.timeAt = function (ev) {
    var box = this.svg.getBoundingClientRect();
    var x = (ev.clientX - box.left) * TL.width / box.width;
    return this.t0 + (x - TL.left) / this.plotWidth() * (this.t1 - this.t0);
  };
  Timeline.prototype.zoom = function (factor, at) {
    var span = (this.t1 - this.t0) * factor, end = this.data.drawn_time_s;
    span = Math.max(end / 1e4, Math.min(end, span));
    var t0 = at - (at - this.t0) * span / (this.t1 - this.t0);
    this.show(t0, t0 + span);
  };
  Timeline.prototype.show = function (t0, t1) {
    var span = t1 - t0, end = this.data.drawn_time_s;
    t0 = Math.max(0, Math.min(t0, end - span));
    this.t0 = t0;
    this.t1 = t0 + span;
    this.render();
  };
  Timeline.prototype.render = function () {
    var d = this.data, svg = this.svg, t0 = this.t0, t1 = this.t1, w = this.plotWidth();
    var height = TL.top + d.num_ranks * TL.row + 26;
    svg.setAttribute("viewBox", "0 0 " + TL.width + " " + height);
    while (svg.firstChild) { svg.removeChild(svg.firstChild); }
    var x = function (t) { return TL.left + (t - t0) / (t1 - t0) * w; };
    var step = niceStep(t1 - t0, 8);
    for (var tick = Math.ceil(t0 / step) * step; tick <= t1; tick += step) {
      svgEl("line", {x1: x(tick), x2: x(tick), y1: TL.top - 4, y2: height - 22, "class": "grid"}, svg);
      if (x(tick) < TL.width - 30) { text(svg, x(tick), height - 8, ms(tick) + " ms", "middle"); }
    }
    for (var r = 0; r < d.num_ranks; r++) {
      var y = TL.top + r * TL.row;
      svgEl("rect", {x: TL.left, y: y + 2, width: w, height: TL.row - 4, fill: D.kinds.idle || "#E8E8E8",
                     "data-tip": "rank " + r + ": idle (bubble " + pct(d.bubble_fraction_per_rank[r] || 0) +
                     " of the step)"}, svg);
      text(svg, 4, y + TL.row / 2 + 4, "rank " + r + " " + pct(d.bubble_fraction_per_rank[r] || 0));
    }
    var colours = Object.keys(D.kinds).map(function (k) { return D.kinds[k]; });
    var labels = svgEl("g", {}, svg);
    d.events.forEach(function (e, i) {
      if (e[5] < t0 || e[4] > t1) { return; }
      var a = Math.max(x(e[4]), TL.left), b = Math.min(x(e[5]), TL.left + w), ey = TL.top + e[0] * TL.row + 2;
      svgEl("rect", {x: a, y: ey, width: Math.max(b - a, 0.6), height: TL.row - 4, fill: colours[e[2]],
                     "class": "ev", "data-i": i}, svg);
      if (b - a > 16 && e[2] !== 5) {
        var t = text(labels, (a + b) / 2, ey + TL.row / 2 + 2, String(e[3]), "middle");
        t.setAttribute("pointer-events", "none");
        t.setAttribute("style", "fill:" + (e[2] === 0 || e[2] === 1 || e[2] === 4 ? "#fff" : "#000"));
      }
    });
    svg.appendChild(labels);
    $("tl-range").textContent = "showing " + ms(t0) + " to " + ms(t1) + " ms of " + ms(d.drawn_time_s) + " ms";
  };

  function timelineSection() {
    if (!D.timelines.length) { return; }
    var sel = $("tl-variant");
    D.timelines.forEach(function (t, i) {
      var o = document.createElement("option");
      o.value = String(i);
      o.textContent = t.label + ": step " + t.step_time_s.toFixed(3) + " s, bubble " + pct(t.bubble_fraction) + " of the step";
      sel.appendChild(o);
    });
    timeline = new Timeline($("timeline"));
    sel.addEventListener("change", function () { timeline.select(+sel.value); });
    $("tl-in").addEventListener("click", function () { timeline.zoom(0.5, (timeline.t0 + timeline.t1) / 2); });
    $("tl-out").addEventListener("click", function () { timeline.zoom(2, (timeline.t0 + timeline.t1) / 2); });
    $("tl-reset").addEventListener("click", function () { timeline.show(0, timeline.data.drawn_time_s); });
    var legend = $("tl-legend");
    Object.keys(D.kinds).forEach(function (k) {
      var s = document.createElement("span");
      s.style.setProperty("--c", D.kinds[k]);
      s.textContent = k;
      legend.appendChild(s);
    });
  }

  /* Memory per stage: stacked parts against each stage's capacity (dashed). */
  function memory() {
    if (!D.memory.length) { return; }
    var svg = $("memory"), parts = Object.keys(D.memory_colours), n = D.memory.length;
    var W = 1100, H = 300, left = 60, bottom = 30, top = 12, plot = H - bottom - top;
    var most = Math.max.apply(null, D.memory.map(function (m) { return Math.max(m.peak_bytes, m.capacity_bytes); }));
    var y = function (b) { return top + plot - b / most / 1.08 * plot; };
    var slot = (W - left - 10) / n;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    var step = niceStep(most * 1.08 / GIB, 6);
    for (var g = 0; g * step * GIB <= most * 1.08; g++) {
      svgEl("line", {x1: left, x2: W - 10, y1: y(g * step * GIB), y2: y(g * step * GIB), "class": "grid"}, svg);
      text(svg, left - 6, y(g * step * GIB) + 4, String(+(g * step).toFixed(3)), "end");
    }
    text(svg, 4, top + 10, "GiB");
    D.memory.forEach(function (m, r) {
      var x0 = left + r * slot + slot * 0.15, base = 0;
      parts.forEach(function (p) {
        var v = m.parts_bytes[p] || 0;
        svgEl("rect", {x: x0, y: y(base + v), width: slot * 0.7, height: y(base) - y(base + v), "class": "part",
                       fill: D.memory_colours[p], "data-tip": "stage " + r + ": " + p + " " + gib(v) + " GiB\npeak " +
                       gib(m.peak_bytes) + " of " + gib(m.capacity_bytes) + " GiB"}, svg);
        base += v;
      });
      svgEl("line", {x1: x0 - slot * 0.1, x2: x0 + slot * 0.8, y1: y(m.capacity_bytes), y2: y(m.capacity_bytes),
                     "class": "cap"}, svg);
      text(svg, x0 + slot * 0.35, H - 10, "stage " + r, "middle");
    });
    hoverable(svg, function (t) { return t.getAttribute("data-tip"); });
    var legend = $("mem-legend");
    parts.forEach(function (p) {
      var s = document.createElement("span");
      s.style.setProperty("--c", D.memory_colours[p]);
      s.textContent = p;
      legend.appendChild(s);
    });
  }

  /* The sweep's curve: tokens/s per GPU (or days, or cost) against GPUs on a log2 axis, per device. */
  var SWEEP_METRICS = {"tokens/s per GPU": "tokens_per_s_per_gpu", "days": "days", "GPU-hours": "gpu_hours",
                       "cost USD": "cost_usd"};
  function sweep() {
    var S = D.sweep;
    if (!S) { return; }
    var sel = $("sweep-metric");
    Object.keys(SWEEP_METRICS).forEach(function (k) {
      var o = document.createElement("option");
      o.textContent = k;
      sel.appendChild(o);
    });
    sel.addEventListener("change", function () { drawSweep(S, SWEEP_METRICS[sel.value]); });
    drawSweep(S, "tokens_per_s_per_gpu");
  }
  function drawSweep(S, key) {
    var svg = $("sweep"), W = 1100, H = 340, left = 80, right = 20, top = 14, bottom = 36;
    while (svg.firstChild) { svg.removeChild(svg.firstChild); }
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    var rows = S.rows.filter(function (r) { return r[key] !== null && r[key] !== undefined; });
    if (!rows.length) { text(svg, W / 2, H / 2, "no size has this figure", "middle"); return; }
    var gpus = rows.map(function (r) { return Math.log2(r.num_gpus); });
    var lo = Math.min.apply(null, gpus), hi = Math.max.apply(null, gpus) + 1e-9;
    var most = Math.max.apply(null, rows.map(function (r) { return r[key]; })) * 1.1;
    var x = function (g) { return left + (Math.log2(g) - lo + 0.25) / (hi - lo + 0.5) * (W - left - right); };
    var y = function (v) { return top + (1 - v / most) * (H - top - bottom); };
    var step = niceStep(most, 6);
    for (var v = 0; v <= most; v += step) {
      svgEl("line", {x1: left, x2: W - right, y1: y(v), y2: y(v), "class": "grid"}, svg);
      text(svg, left - 6, y(v) + 4, num(v, 2), "end");
    }
    rows.forEach(function (r) { text(svg, x(r.num_gpus), H - 12, num(r.num_gpus, 0), "middle"); });
    text(svg, W - right, H - 24, "GPUs", "end");
    var devices = rows.map(function (r) { return r.device; }).filter(function (d, i, a) { return a.indexOf(d) === i; });
    var palette = ["#0072B2", "#D55E00", "#009E73", "#E69F00", "#CC79A7", "#56B4E9"];
    devices.forEach(function (dev, k) {
      var mine = rows.filter(function (r) { return r.device === dev; }), c = palette[k % palette.length];
      svgEl("polyline", {points: mine.map(function (r) { return x(r.num_gpus) + "," + y(r[key]); }).join(" "),
                         fill: "none", stroke: c, "stroke-width": 2}, svg);
      mine.forEach(function (r) {
        var knee = S.knees[dev] === r.num_gpus, best = S.best && S.best.device === dev && S.best.num_gpus === r.num_gpus;
        /* a size past the deadline or over the budget is not an answer: hollow, its reason in the tip */
        svgEl("circle", {cx: x(r.num_gpus), cy: y(r[key]), r: best ? 7 : knee ? 6 : 4,
                         fill: best ? "#000" : r.outside_limits ? "#fff" : c, stroke: c, "stroke-width": 1.5,
                         "class": "pt", "data-tip": dev + ", " + num(r.num_gpus, 0) + " GPUs" + (knee ? " (knee)" : "") +
                         (best ? " (" + (S.objective === "time" ? "ends soonest" : "cheapest") + ")" : "") +
                         (r.outside_limits ? " (" + r.outside_limits + ")" : "") +
                         "\n" + r.plan_label + "\n" + sweepLine(r)}, svg);
      });
      text(svg, W - right - 8, top + 14 + 16 * k, dev, "end").setAttribute("style", "fill:" + c);
    });
    hoverable(svg, function (t) { return t.getAttribute("data-tip"); });
  }
  function sweepLine(r) {
    return num(r.tokens_per_s_per_gpu, 0) + " tokens/s per GPU, " + num(r.days, 1) + " days, " +
      num(r.gpu_hours, 0) + " GPU-hours" + (r.cost_usd === null ? "" : ", $" + num(r.cost_usd, 0));
  }

