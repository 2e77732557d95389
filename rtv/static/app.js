/* ringq Real Time Viewer: polls this server's proxy of the monitor API once a
 * refresh interval (1 s by default) and redraws the queue table and the
 * selected queue's uPlot charts. Plain JS, no build step. */
(function () {
  "use strict";

  var state = {
    refresh: 1.0,            // seconds, from /api/config
    windows: [{ label: "5 min", seconds: 300 }],
    windowSec: 300,
    queue: null,             // the selected queue's name
    points: [],              // its history, oldest first
    lastT: null,             // time of the newest point
    queues: [],              // the latest /api/queues rows
    server: null,            // the line about the server the monitor is on: {text, alarm}
    clients: [],             // the latest /api/clients rows, workers first
    clientsError: null,      // why they could not be read (the queues still show)
    thinned: false,
    step: 0,                 // seconds per bucket of the thinned part (0: raw samples)
    interval: null,          // the monitor's sampling interval, seconds
    ticks: 0,                // completed refreshes (read by the tests)
    error: null,
  };
  var charts = {};
  var generation = 0;        // bumps on queue/window change to drop stale answers

  // The token, when it came in the address, also set a cookie for this
  // port; take it out of the address bar (and of any bookmark or history).
  if (location.search.indexOf("token=") >= 0 && window.history && history.replaceState) {
    history.replaceState(null, "", location.pathname + location.hash);
  }

  // ---- formatting ----------------------------------------------------------

  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  function num(v, digits) {
    if (v === null || v === undefined) return "–";
    if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + "k";
    return digits ? v.toFixed(digits) : String(Math.round(v));
  }
  function micros(v) {
    if (v === null || v === undefined) return "–";
    if (v >= 1e6) return (v / 1e6).toFixed(2) + " s";
    if (v >= 1e3) return (v / 1e3).toFixed(v >= 1e4 ? 0 : 1) + " ms";
    return Math.round(v) + " µs";
  }
  function clock(t) {
    return new Date(t * 1000).toLocaleTimeString();
  }

  // ---- server ----------------------------------------------------------------

  function getJSON(url) {
    return fetch(url, { credentials: "same-origin", cache: "no-store" }).then(function (r) {
      return r.json().catch(function () { return {}; }).then(function (body) {
        if (!r.ok) {
          var err = new Error(body.error || r.status + " " + r.statusText);
          err.status = r.status;
          throw err;
        }
        return body;
      });
    });
  }

  // ---- charts ----------------------------------------------------------------

  var C = {
    enq: "#2563eb", deq: "#16a34a", p50: "#2563eb", p99: "#dc2626",
    depth: "#7c3aed", cap: "#64748b", full: "#dc2626", empty: "#94a3b8",
    retries: "#d97706", exceptions: "#dc2626",
  };
  var stepped = uPlot.paths && uPlot.paths.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined;

  // The window, or less while the monitor's history is shorter than it (a
  // monitor started a minute ago fills the width instead of a sliver).
  function xRange() {
    var to = state.lastT || Date.now() / 1000;
    var from = to - state.windowSec;
    if (state.points.length > 1) from = Math.max(from, state.points[0].t - interval());
    return [from, Math.max(to, from + 10 * interval())];
  }
  function interval() { return state.interval || state.refresh || 1; }

  // Shade, under the plotted lines, the samples during which the queue was
  // full (or empty): the deeper the colour, the larger the share of the
  // interval (the monitor gives seconds per interval).
  function shade(key, rgb) {
    return function (u) {
      var pts = state.points;
      if (!pts.length) return;
      var ctx = u.ctx, top = u.bbox.top, height = u.bbox.height;
      ctx.save();
      for (var i = 0; i < pts.length; i++) {
        var share = Math.min(1, (pts[i][key] || 0) / interval());
        if (share <= 0) continue;
        var start = i > 0 ? pts[i - 1].t : pts[i].t - interval();
        var x0 = u.valToPos(start, "x", true), x1 = u.valToPos(pts[i].t, "x", true);
        ctx.fillStyle = "rgba(" + rgb + "," + (0.08 + 0.22 * share).toFixed(3) + ")";
        ctx.fillRect(x0, top, Math.max(1, x1 - x0), height);
      }
      ctx.restore();
    };
  }
  function share(key) {
    return function (p) { return p[key] === null || p[key] === undefined ? null : Math.min(1, p[key] / interval()); };
  }
  function pct(v) { return v === null || v === undefined ? "–" : Math.round(v * 100) + "%"; }
  // A call-latency chart: the p50 and p99 of "<call>_p50_us" and "<call>_p99_us".
  function latency(call, label) {
    function series(p, stroke) {
      return { label: label + " " + p, stroke: stroke, width: 2, value: function (u, v) { return micros(v); } };
    }
    return {
      keys: [call + "_p50_us", call + "_p99_us"],
      series: [series("p50", C.p50), series("p99", C.p99)],
      latency: true,
    };
  }

  var SPECS = {
    depth: {
      keys: ["depth", "capacity"],
      series: [
        { label: "depth", stroke: C.depth, fill: "rgba(124,58,237,.12)", width: 2 },
        { label: "capacity", stroke: C.cap, dash: [6, 4], width: 1 },
      ],
      yRange: function (u, min, max) { return [0, Math.max(1, max) * 1.05]; },
      hooks: { drawClear: [shade("full", "220,38,38"), shade("empty", "148,163,184")] },
    },
    rates: {
      keys: ["enq_rate", "deq_rate"],
      series: [
        { label: "enqueue/s", stroke: C.enq, width: 2, value: function (u, v) { return num(v, 1); } },
        { label: "dequeue/s", stroke: C.deq, width: 2, value: function (u, v) { return num(v, 1); } },
      ],
      yRange: function (u, min, max) { return [0, Math.max(1, max) * 1.1]; },
    },
    enq: latency("enq", "EnQ"),
    deq: latency("deq", "DeQ"),
    state: {
      keys: [share("full"), share("empty")],
      series: [
        { label: "full", stroke: C.full, fill: "rgba(220,38,38,.25)", paths: stepped, width: 1, value: function (u, v) { return pct(v); } },
        { label: "empty", stroke: C.empty, fill: "rgba(148,163,184,.3)", paths: stepped, width: 1, value: function (u, v) { return pct(v); } },
      ],
      height: 140,
      yRange: function () { return [0, 1.02]; },
      yValues: function (u, splits) { return splits.map(pct); },
      ySplits: function () { return [0, 0.5, 1]; },
    },
    faults: {
      keys: ["retries", "exceptions"],
      series: [
        { label: "retries", stroke: C.retries, paths: stepped, width: 2 },
        { label: "exceptions", stroke: C.exceptions, paths: stepped, width: 2 },
      ],
      yRange: function (u, min, max) { return [0, Math.max(1, max) * 1.1]; },
    },
  };

  function makeChart(name) {
    var spec = SPECS[name], el = document.getElementById("chart-" + name);
    var yAxis = { size: 64 };
    if (spec.latency) yAxis.values = function (u, splits) { return splits.map(micros); };
    if (spec.yValues) yAxis.values = spec.yValues;
    if (spec.ySplits) yAxis.splits = spec.ySplits;
    var opts = {
      width: Math.max(300, el.clientWidth || 520),
      height: spec.height || 200,
      series: [{}].concat(spec.series.map(function (s) {
        var o = { label: s.label, stroke: s.stroke, width: s.width || 1, spanGaps: false };
        if (s.fill) o.fill = s.fill;
        if (s.dash) o.dash = s.dash;
        if (s.paths) o.paths = s.paths;
        if (s.value) o.value = s.value;
        return o;
      })),
      scales: {
        x: { time: true, range: function () { return xRange(); } },
        y: { range: spec.yRange || function (u, min, max) { return [0, Math.max(1, max) * 1.1]; } },
      },
      axes: [{}, yAxis],
      cursor: { drag: { x: false, y: false } },
      hooks: spec.hooks || {},
    };
    charts[name] = new uPlot(opts, columns(spec.keys), el);
  }

  // uPlot's columns: times, then one array per key (a name, or a function of a point).
  function columns(keys) {
    var pts = state.points, out = [pts.map(function (p) { return p.t; })];
    keys.forEach(function (k) {
      out.push(pts.map(typeof k === "function" ? k : function (p) { return p[k]; }));
    });
    return out;
  }

  function redrawCharts() {
    Object.keys(SPECS).forEach(function (name) {
      if (!charts[name]) makeChart(name);
      else charts[name].setData(columns(SPECS[name].keys));
    });
  }

  function resizeCharts() {
    Object.keys(charts).forEach(function (name) {
      var el = document.getElementById("chart-" + name);
      charts[name].setSize({ width: Math.max(300, el.clientWidth), height: SPECS[name].height || 200 });
    });
  }
  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(resizeCharts, 150);
  });

  // ---- table -----------------------------------------------------------------

  // The queue now, from depth and capacity; with the seconds it spent full
  // (or empty) during the last interval when it did.
  function stateBadge(q) {
    var badge;
    if (q.capacity && q.depth >= q.capacity) badge = '<span class="badge full">FULL</span>';
    else if (q.depth === 0) badge = '<span class="badge empty">empty</span>';
    else badge = '<span class="badge ok">flowing</span>';
    if (q.full > 0) badge += ' <small title="seconds full in the last interval">full ' + q.full.toFixed(1) + " s</small>";
    return badge;
  }

  function renderTable() {
    var body = document.querySelector("#queues tbody");
    if (!state.queues.length) {
      body.innerHTML = '<tr><td colspan="14" class="empty-note">the monitor reports no queue</td></tr>';
      return;
    }
    body.innerHTML = state.queues.map(function (q) {
      var cap = q.capacity || 0, depth = q.depth || 0;
      var pct = cap ? Math.min(100, (100 * depth) / cap) : 0;
      return (
        '<tr data-queue="' + esc(q.name) + '"' + (q.name === state.queue ? ' class="selected"' : "") + ">" +
        '<td class="name">' + esc(q.name) + "</td>" +
        '<td><span class="bar"><i class="' + (pct >= 80 ? "hot" : "") + '" style="width:' + pct.toFixed(1) + '%"></i></span>' +
        num(q.depth) + " / " + num(q.capacity) + "</td>" +
        "<td>" + stateBadge(q) + "</td>" +
        "<td>" + num(q.enq_rate, 1) + "</td>" +
        "<td>" + num(q.deq_rate, 1) + "</td>" +
        "<td>" + micros(q.enq_p50_us) + " / " + micros(q.enq_p99_us) + "</td>" +
        "<td>" + micros(q.deq_p50_us) + " / " + micros(q.deq_p99_us) + "</td>" +
        "<td>" + num(q.retries) + "</td>" +
        "<td>" + num(q.exceptions) + "</td>" +
        "<td>" + num(q.commits) + "</td>" +
        "<td>" + num(q.rollbacks) + "</td>" +
        "<td>" + num(q.waiting_dequeuers) + " / " + num(q.waiting_enqueuers) + "</td>" +
        "<td>" + num(q.head) + " / " + num(q.tail) + "</td>" +
        "<td>" + num(q.dead_rows) + "</td>" +
        "</tr>" +
        // A grouped queue's groups, on a row of their own below it (no column for the others).
        (q.groups_line ? '<tr class="groups" data-queue="' + esc(q.name) + '"><td></td>' +
          '<td class="name" colspan="13">' + esc(q.groups_line) + "</td></tr>" : "") +
        // Entries waiting for their due time (delays, retry backoff): a row below it too.
        (q.waiting_line ? '<tr class="waiting" data-queue="' + esc(q.name) + '"><td></td>' +
          '<td class="name" colspan="13">' + esc(q.waiting_line) + "</td></tr>" : "")
      );
    }).join("");
  }

  // A worker's throughput is messages handled per second; a plain client's,
  // commits per second. The worker counters mean nothing for a client: "–".
  function renderClients() {
    var body = document.querySelector("#clients tbody");
    if (state.clientsError) {
      body.innerHTML = '<tr><td colspan="10" class="empty-note">clients unavailable: ' + esc(state.clientsError) + "</td></tr>";
      return;
    }
    if (!state.clients.length) {
      body.innerHTML = '<tr><td colspan="10" class="empty-note">no session attached</td></tr>';
      return;
    }
    body.innerHTML = state.clients.map(function (c) {
      var worker = c.role === "worker";
      function counter(v, bad) {
        if (!worker) return "<td>–</td>";
        return "<td" + (bad && v > 0 ? ' class="bad"' : "") + ">" + num(v) + "</td>";
      }
      var rate = worker ? num(c.handled_rate, 1) + " msg/s" : num(c.commit_rate, 1) + " commit/s";
      var last = c.last_error, errTitle = "";
      if (last) {
        errTitle = ' title="last: ' + esc(last.kind) + (last.queue ? " on " + esc(last.queue) : "") +
          (last.seq !== null && last.seq !== undefined ? " seq " + last.seq : "") +
          (last.t ? " at " + clock(last.t) : "") + '"';
      }
      var active = c.state === "active";
      return (
        '<tr data-pid="' + esc(c.pid) + '" data-role="' + esc(c.role) + '">' +
        "<td>" + esc(c.pid) + "</td>" +
        '<td class="name"><span class="badge ' + (worker ? "worker" : "client") + '">' + esc(c.role) + "</span></td>" +
        '<td class="name">' + (c.queues.length ? esc(c.queues.join(", ")) : "–") + "</td>" +
        "<td>" + rate + "</td>" +
        counter(c.handled, false) +
        counter(c.failed, true) +
        counter(c.timeouts, true) +
        counter(c.poisoned, true) +
        "<td" + (c.errors > 0 ? ' class="bad"' : "") + errTitle + ">" + num(c.errors) + "</td>" +
        '<td class="name"><span class="badge ' + (active ? "ok" : "doubt") + '">' + esc(c.state) + "</span></td>" +
        "</tr>"
      );
    }).join("");
  }

  document.querySelector("#queues tbody").addEventListener("click", function (ev) {
    var tr = ev.target.closest("tr[data-queue]");
    if (tr) select(tr.getAttribute("data-queue"));
  });

  // ---- status ----------------------------------------------------------------

  function setStatus(kind, text) {
    var el = document.getElementById("status");
    el.className = "status " + kind;
    el.textContent = text;
    el.title = text;
  }

  // Which server the monitor is on (the viewer's server writes the line, the
  // same as the terminal view's and `ringq status`'s); hidden when the
  // monitor does not say.
  function renderServer(line) {
    state.server = line || null;
    var el = document.getElementById("server");
    el.hidden = !line;
    el.textContent = line ? line.text : "";
    el.className = "server" + (line && line.alarm ? " bad" : "");
  }

  function showError(err) {
    state.error = err.message;
    if (err.status === 401) setStatus("bad", "token rejected: open the address printed by `ringq rtv`");
    else if (err.status === 502) setStatus("bad", err.message);
    else setStatus("bad", "viewer unreachable: " + err.message);
  }

  // ---- refresh loop ----------------------------------------------------------

  function select(name) {
    if (name === state.queue) return;
    state.queue = name;
    state.points = [];
    state.lastT = null;
    generation++;
    document.getElementById("detail-name").textContent = name || "—";
    if (name) location.hash = "queue=" + encodeURIComponent(name);
    renderTable();
    redrawCharts();
  }

  // Ask for no more points than the charts have pixels across: the monitor
  // thins a long window (the day, from its T4 files) into that many buckets.
  function drawablePoints() {
    var el = document.getElementById("chart-depth") || document.body;
    return Math.max(100, Math.round((el && el.clientWidth) || 1000));
  }

  function historyURL() {
    var q = "/api/history?queue=" + encodeURIComponent(state.queue) + "&max_points=" + drawablePoints();
    if (state.lastT !== null) return q + "&since=" + state.lastT;
    return q + "&window=" + state.windowSec;
  }

  function mergeHistory(body) {
    var pts = body.points || [];
    if (body.interval) state.interval = body.interval;
    if (state.lastT === null) { state.thinned = !!body.thinned; state.step = body.step || 0; }
    for (var i = 0; i < pts.length; i++) {
      if (state.lastT === null || pts[i].t > state.lastT) {
        state.points.push(pts[i]);
        state.lastT = pts[i].t;
      }
    }
    if (state.lastT === null && pts.length === 0) state.lastT = null;
    var from = (state.lastT || body.t) - state.windowSec, drop = 0;
    while (drop < state.points.length && state.points[drop].t < from) drop++;
    if (drop) state.points.splice(0, drop);
    document.getElementById("detail-note").textContent =
      state.points.length + " samples" + (state.thinned ? ", older ones summarized per " +
        (state.step ? state.step + " s " : "") + "bucket" : "");
  }

  // The clients are read alongside the queues; their failure (a monitor
  // older than /api/clients) is shown in their table and spares the rest.
  function fetchClients() {
    return getJSON("/api/clients").then(function (body) {
      state.clients = body.clients || [];
      state.clientsError = null;
    }, function (err) {
      state.clientsError = err.message;  // a 401 also fails /api/queues, which says so
    });
  }

  function tick() {
    var gen = generation;
    var clients = fetchClients();
    return getJSON("/api/queues").then(function (body) {
      state.queues = body.queues || [];
      if (body.interval) state.interval = body.interval;
      renderServer(body.server_line);
      if (!state.queue || !state.queues.some(function (q) { return q.name === state.queue; })) {
        var wanted = decodeURIComponent((location.hash.match(/queue=([^&]+)/) || [])[1] || "");
        var pick = state.queues.some(function (q) { return q.name === wanted; }) ? wanted
          : state.queues.length ? state.queues[0].name : null;
        if (pick !== state.queue) { select(pick); gen = generation; }
      }
      renderTable();
      if (!state.queue) return null;
      return getJSON(historyURL());
    }).then(function (hist) {
      if (hist && gen === generation && hist.queue === state.queue) {
        mergeHistory(hist);
        redrawCharts();
      }
      return clients;
    }).then(function () {
      renderClients();
      state.error = null;
      state.ticks++;
      document.body.setAttribute("data-ticks", String(state.ticks));
      setStatus("ok", "live · every " + state.refresh + " s");
      document.getElementById("updated").textContent = "updated " + clock(Date.now() / 1000);
    }).catch(showError);
  }

  function loop() {
    var started = Date.now();
    tick().then(function () {
      setTimeout(loop, Math.max(50, state.refresh * 1000 - (Date.now() - started)));
    });
  }

  function setupWindows() {
    var sel = document.getElementById("window");
    sel.innerHTML = state.windows.map(function (w) {
      return '<option value="' + w.seconds + '">' + esc(w.label) + "</option>";
    }).join("");
    sel.value = String(state.windowSec);
    sel.addEventListener("change", function () {
      state.windowSec = Number(sel.value);
      state.points = [];
      state.lastT = null;
      generation++;
      redrawCharts();
      tick();
    });
  }

  getJSON("/api/config").then(function (cfg) {
    state.refresh = cfg.refresh || 1.0;
    state.windows = cfg.windows || state.windows;
    state.windowSec = cfg.window || state.windows[0].seconds;
    document.getElementById("monitor").textContent = "from the monitor at " + cfg.monitor;
  }).catch(showError).then(function () {
    setupWindows();
    redrawCharts();
    loop();
  });

  // For tests and the curious: the live state and the uPlot instances.
  window.ringqRtv = { state: state, charts: charts };
})();
