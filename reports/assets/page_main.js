/* Part 3 of the page's script: the self-test and the start. */
  /* #selftest: sort a table both ways, zoom the timeline in and out, hover a bar of each picture. */
  function selfTest() {
    var fails = [];
    var check = function (ok, what) { if (!ok) { fails.push(what); } };
    var tables = Array.prototype.slice.call(document.querySelectorAll("table.sortable"))
      .filter(function (t) { return t.tBodies[0] && t.tBodies[0].rows.length > 1; });
    tables.forEach(function (t) {
      var col = t.tHead.rows[0].cells.length - 1 > 2 ? 2 : 1, th = t.tHead.rows[0].cells[col];
      var keys = function () { return Array.prototype.map.call(t.tBodies[0].rows, function (r) { return cellKey(r.cells[col]); }); };
      th.dispatchEvent(new MouseEvent("click", {bubbles: true}));
      var up = keys();
      th.dispatchEvent(new MouseEvent("click", {bubbles: true}));
      var down = keys();
      check(up.every(function (k, i) { return i === 0 || !(k < up[i - 1]); }), "sort ascending: " + th.textContent);
      check(down.every(function (k, i) { return i === 0 || !(k > down[i - 1]); }), "sort descending: " + th.textContent);
    });
    check(tables.length > 0, "no sortable table with two rows");
    if (timeline) {
      var svg = timeline.svg, box = svg.getBoundingClientRect(), span = timeline.t1 - timeline.t0;
      svg.dispatchEvent(new WheelEvent("wheel", {deltaY: -120, clientX: box.left + box.width / 2,
                                                 clientY: box.top + box.height / 2, bubbles: true, cancelable: true}));
      check(timeline.t1 - timeline.t0 < span * 0.9, "wheel zoom in");
      $("tl-out").click();
      check(timeline.t1 - timeline.t0 > span * 0.9, "zoom out");
      hoverCheck(svg.querySelector("rect.ev"), "micro-batch", check);
      $("tl-reset").click();
    }
    hoverCheck(document.querySelector("#memory rect.part"), "GiB", check, !D.memory.length);
    hoverCheck(document.querySelector("#sweep circle.pt"), "GPUs", check, !D.sweep);
    tip.hidden = true;
    return fails;
  }
  function hoverCheck(target, word, check, absent) {
    if (absent) { return; }
    check(target !== null, "nothing to hover for '" + word + "'");
    if (!target) { return; }
    var box = target.getBoundingClientRect();
    target.dispatchEvent(new MouseEvent("mouseover", {bubbles: true, clientX: box.left + 1, clientY: box.top + 1}));
    check(!tip.hidden && tip.textContent.indexOf(word) >= 0, "hover shows '" + word + "': " + tip.textContent);
  }

  function finish(fails, selftest) {
    var errors = (window.__reportErrors || []).concat(fails);
    var status = $("report-status");
    status.dataset.status = errors.length ? "error" : "ok";
    status.dataset.errors = String(errors.length);
    status.dataset.selftest = selftest ? (fails.length ? "failed" : "passed") : "not run";
    status.textContent = "page " + status.dataset.status + (selftest ? ", self-test " + status.dataset.selftest : "");
    $("report-errors").textContent = errors.join("\n");
  }

  var selftest = window.location.hash === "#selftest", fails = [];
  try {
    Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (t) {
      if (t.id !== "ranking") { makeSortable(t); }
    });
    ranking();
    timelineSection();
    memory();
    sweep();
    if ($("ranking") && $("ranking").tHead) { makeSortable($("ranking")); }
    fails = selftest ? selfTest() : [];
  } catch (err) {
    fails.push("exception: " + err + (err && err.stack ? "\n" + err.stack : ""));
  }
  finish(fails, selftest);
