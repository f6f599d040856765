// pgqueue dashboard: renders the snapshots the server pushes over Server-Sent Events.
// Everything from the database is written with textContent, never as HTML.
(function () {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const state = { snap: null, receivedAt: 0, charts: {}, depthKey: "", legendKey: "", paused: new Set(), seenFeed: new Set(), openErrors: new Set(), fullErrors: new Map() };

  // --- formatting ------------------------------------------------------------------------
  function fmtSeconds(s) {
    if (s === null || s === undefined) return "–";
    const a = Math.abs(s);
    if (a < 0.001) return (s * 1e6).toFixed(0) + " µs";
    if (a < 1) return (s * 1000).toFixed(a < 0.01 ? 1 : 0) + " ms";
    if (a < 60) return s.toFixed(a < 10 ? 2 : 1) + " s";
    if (a < 3600) return Math.floor(a / 60) + "m " + String(Math.floor(a % 60)).padStart(2, "0") + "s";
    if (a < 86400) return Math.floor(a / 3600) + "h " + String(Math.floor((a % 3600) / 60)).padStart(2, "0") + "m";
    return Math.floor(a / 86400) + "d " + Math.floor((a % 86400) / 3600) + "h";
  }
  function fmtAgo(s) { return s === null || s === undefined ? "–" : (s < 0 ? "in " + fmtSeconds(-s) : fmtSeconds(s) + " ago"); }
  function fmtRelative(s) { return s === null || s === undefined ? "–" : (s >= 0 ? "in " + fmtSeconds(s) : fmtSeconds(-s) + " ago"); }
  function fmtInt(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
  function fmtRate(r) { return r === null || r === undefined ? "–" : (r >= 100 ? r.toFixed(0) : r >= 10 ? r.toFixed(1) : r.toFixed(2)); }
  function pair(a, b) { return a === null || a === undefined ? "–" : fmtSeconds(a) + " / " + fmtSeconds(b); }
  function shortId(id) { return id ? String(id).slice(0, 8) : "–"; }
  function elapsed() { return (performance.now() - state.receivedAt) / 1000; }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function cell(text, cls) { return el("td", cls, text); }
  function emptyRow(cols, text) { const tr = el("tr", "empty-row"); const td = cell(text); td.colSpan = cols; tr.append(td); return tr; }
  // A job id that opens its detail page (/jobs/{id}; relative, so a prefix in front still works).
  function jobLink(id) { const a = el("a", "job-link", "#" + id); a.href = "jobs/" + encodeURIComponent(id); return a; }
  function jobCell(id) { const td = cell("", "num"); td.append(jobLink(id)); return td; }
  function setText(id, text) { const node = $(id); if (node.textContent !== text) node.textContent = text; }

  // --- connection state ------------------------------------------------------------------
  function setConn(kind, text, reason) {
    const conn = $("conn");
    conn.dataset.state = kind;
    $("conn-text").textContent = text;
    document.body.classList.toggle("stale", kind === "reconnecting");
    $("banner").hidden = kind !== "reconnecting" || !reason;
    if (reason) setText("banner-text", reason);
  }

  // --- tiles -----------------------------------------------------------------------------
  // p50 large, p95 beside it smaller: both fit a narrow tile.
  function setPair(id, a, b) {
    const text = pair(a, b);
    const node = $(id);
    if (node.dataset.text === text) return;
    node.dataset.text = text;
    if (a === null || a === undefined) { node.textContent = "–"; return; }
    node.replaceChildren(el("span", "", fmtSeconds(a)), el("span", "p95", " / " + fmtSeconds(b)));
  }

  function renderTiles(t) {
    setText("t-throughput", fmtRate(t.throughput));
    setPair("t-pickup", t.pickup_p50, t.pickup_p95);
    setPair("t-run", t.run_p50, t.run_p95);
    setText("t-waiting", fmtInt(t.waiting));
    setText("t-running", fmtInt(t.running));
    setText("t-retries", fmtInt(t.retries_60s));
    setText("t-failed", fmtInt(t.failed_60s));
    $("t-failed").parentElement.classList.toggle("hot", t.failed_60s > 0);
  }

  // --- charts (uPlot) --------------------------------------------------------------------
  function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }
  function chartSize(node) { return { width: Math.max(node.clientWidth, 200), height: 200 }; }
  function axes() {
    const ink = cssVar("--muted"), grid = cssVar("--line");
    const common = { stroke: ink, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
    const clock = (u, ticks) => ticks.map((v) => new Date(v * 1000).toLocaleTimeString([], { hour12: false }));
    return [Object.assign({}, common, { values: clock, space: 70 }), Object.assign({}, common, { size: 48 })];
  }

  function renderThroughput(tp) {
    if (!window.uPlot) return;
    // Seconds not settled yet are gaps, not a drop to zero at the chart's right edge.
    const open = (i) => tp.settled_until !== undefined && tp.t[i] > tp.settled_until;
    const succeeded = tp.succeeded.map((s, i) => (open(i) ? null : s));
    const total = tp.succeeded.map((s, i) => (open(i) ? null : s + tp.failed[i]));
    const data = [tp.t, total, succeeded];
    if (!state.charts.tp) {
      const node = $("chart-throughput");
      const ok = cssVar("--ok"), bad = cssVar("--bad");
      state.charts.tp = new window.uPlot(Object.assign(chartSize(node), {
        legend: { show: false }, cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max, 1) * 1.1] } },
        axes: axes(),
        series: [{}, { label: "failed / dead", stroke: bad, fill: bad + "cc", width: 1, points: { show: false } },
                 { label: "succeeded", stroke: ok, fill: ok + "cc", width: 1, points: { show: false } }],
      }), data, node);
    } else {
      state.charts.tp.setData(data);
    }
  }

  // A queue's name, with a "paused" badge while operators have paused it (pgqueue queues pause).
  function queueName(name, cls) {
    const node = el("span", cls, name);
    if (state.paused.has(name)) {
      const pill = el("span", "pill paused", "paused");
      pill.title = "Paused: no worker claims its jobs until `pgqueue queues resume`; running jobs finish.";
      node.append(" ", pill);
    }
    return node;
  }
  function queueCell(name) { const td = cell(""); td.append(queueName(name)); return td; }

  const QUEUE_COLOURS = ["--q1", "--q2", "--q3", "--q4", "--q5", "--q6"];
  function renderDepth(depth) {
    const names = Object.keys(depth.queues);
    $("depth-empty").hidden = names.length > 0;
    $("chart-depth").hidden = names.length === 0;
    const key = names.join("\u0000");
    if (key !== state.depthKey) {
      state.depthKey = key;
      if (state.charts.depth) { state.charts.depth.destroy(); state.charts.depth = null; }
    }
    // Paused queues with nothing waiting have no line, but are still named (without a colour key).
    const idle = [...state.paused].filter((n) => !(n in depth.queues));
    const legendKey = key + "\u0001" + [...state.paused].join("\u0000");
    if (legendKey !== state.legendKey) {
      state.legendKey = legendKey;
      $("depth-legend").replaceChildren(
        ...names.flatMap((n, i) => [el("span", "key q" + (i % 6)), queueName(n, "qname")]),
        ...idle.map((n) => queueName(n, "qname idle")));
    }
    if (!window.uPlot || names.length === 0) return;
    const data = [depth.t, ...names.map((n) => depth.queues[n])];
    if (!state.charts.depth) {
      const node = $("chart-depth");
      state.charts.depth = new window.uPlot(Object.assign(chartSize(node), {
        legend: { show: false }, cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max, 1) * 1.1] } },
        axes: axes(),
        series: [{}, ...names.map((n, i) => ({ label: n, stroke: cssVar(QUEUE_COLOURS[i % 6]), width: 2, points: { show: false } }))],
      }), data, node);
    } else {
      state.charts.depth.setData(data);
    }
  }

  // --- lists -----------------------------------------------------------------------------
  function renderWorkers(workers, lateAfter) {
    $("workers-empty").hidden = workers.length > 0;
    $("workers").replaceChildren(...workers.map((w) => {
      const li = el("li", w.late ? "late" : "");
      li.dataset.heartbeat = String(w.heartbeat_age);
      const who = el("span", "who", w.host + " · pid " + w.pid);
      if (w.late) {
        const pill = el("span", "pill late", "late");
        pill.title = "No heartbeat for more than " + fmtSeconds(lateAfter) + ": stalled, partitioned or gone. Its leases expire and the reaper recovers its jobs.";
        who.append(" ", pill);
      }
      const hb = el("span", "hb", "");
      hb.dataset.age = String(w.heartbeat_age);
      const meter = el("span", "meter");
      const fill = el("span", "fill");
      fill.dataset.width = String(Math.min(100, Math.round(100 * w.leases / Math.max(w.concurrency, 1))));
      meter.append(fill);
      meter.title = w.leases + " of " + w.concurrency + " slots hold a lease";
      const leases = el("span", "leases", w.leases + " / " + w.concurrency + " leases");
      const queues = w.queues && w.queues.length
        ? w.queues.map((q) => (state.paused.has(q) ? q + " (paused)" : q)).join(", ") : "all queues";
      const meta = el("span", "meta", shortId(w.id) + " · " + queues + " · up " + fmtSeconds(w.uptime) +
        (w.stale_writes ? " · " + w.stale_writes + " stale writes refused" : ""));
      li.append(el("span", "beat"), who, hb, meter, leases, meta);
      return li;
    }));
    // Widths go through the CSSOM (allowed by the CSP), never through inline style attributes.
    for (const fill of document.querySelectorAll(".workers .fill")) fill.style.width = fill.dataset.width + "%";
  }

  function renderFeed(feed) {
    const list = $("feed");
    if (!feed.length) { list.replaceChildren(el("li", "empty", "Waiting for jobs…")); return; }
    const first = state.seenFeed.size === 0;
    const seen = new Set();
    list.replaceChildren(...feed.map((e) => {
      const key = e.id + ":" + e.event + ":" + e.at;
      seen.add(key);
      const li = el("li", !first && !state.seenFeed.has(key) ? "new" : "");
      li.append(el("span", "ev " + e.event, e.event));
      const what = el("span", "what");
      what.append(jobLink(e.id), " " + e.task + " · " + e.queue + (e.attempt > 1 ? " · attempt " + e.attempt : ""));
      li.append(what);
      const ago = el("span", "ago");
      ago.dataset.at = String(e.at);
      li.append(ago);
      return li;
    }));
    state.seenFeed = seen;
  }

  // A running job's last ctx.progress(...): a bar when it has a total, the count otherwise;
  // the note, if any, beside it and in the tooltip.
  function progressBar(p) {
    const box = el("span", "progress");
    const current = Number(p.current), total = p.total === undefined ? null : Number(p.total);
    let label = fmtInt(current);
    if (total !== null && total > 0) {
      const bar = el("progress");
      bar.max = total; bar.value = Math.max(0, Math.min(current, total));
      box.append(bar);
      label = Math.round(100 * bar.value / total) + "%";
    }
    box.append(el("span", "progress-label", p.note ? label + " · " + p.note : label));
    box.title = (total !== null ? fmtInt(current) + " / " + fmtInt(total) : fmtInt(current))
      + (p.note ? " — " + p.note : "");
    return box;
  }

  // after= links: how many jobs this one runs after, and how many wait for it.
  function family(r) {
    const parts = [];
    if (r.parents) parts.push("after " + fmtInt(r.parents) + (r.parents === 1 ? " job" : " jobs"));
    if (r.children) parts.push(fmtInt(r.children) + (r.children === 1 ? " job waits" : " jobs wait"));
    return el("span", "family", parts.join(" · "));
  }

  function renderRunning(rows) {
    const body = $("running");
    if (!rows.length) { body.replaceChildren(emptyRow(7, "Nothing is running right now")); return; }
    body.replaceChildren(...rows.map((r) => {
      const tr = el("tr");
      const task = cell(r.task); task.append(el("span", "args mono", r.args));
      if (r.progress) task.append(progressBar(r.progress));
      if (r.parents || r.children) task.append(family(r));
      const running = cell("", "num running-for"); running.dataset.base = String(r.running_for);
      const lease = cell("", "num lease"); lease.dataset.base = String(r.lease_left);
      tr.append(jobCell(r.id), task, queueCell(r.queue), cell(shortId(r.worker), "mono"),
        cell(r.attempt + " / " + r.max_attempts, "num"), running, lease);
      return tr;
    }));
  }

  async function loadError(id, pre) {
    if (state.fullErrors.has(id)) { pre.textContent = state.fullErrors.get(id); return; }
    pre.textContent = "loading…";
    try {
      const response = await fetch("api/jobs/" + encodeURIComponent(id), { headers: { Accept: "application/json" } });
      const job = await response.json();
      const text = response.ok ? (job.last_error || "(no error recorded)") + "\n\nargs: " + job.args : (job.error || "not found");
      state.fullErrors.set(id, text);
      pre.textContent = text;
    } catch (err) {
      pre.textContent = "could not load the error: " + err;
    }
  }

  function renderProblems(rows, counts) {
    setText("problem-counts", counts ? "· " + fmtInt(counts.dead) + " dead · " + fmtInt(counts.retrying) + " retrying" : "");
    const body = $("problems");
    if (!rows.length) { body.replaceChildren(emptyRow(6, "Nothing here")); return; }
    body.replaceChildren(...rows.map((r) => {
      const tr = el("tr");
      tr.dataset.job = String(r.id);
      const task = cell(r.task); task.append(el("span", "args mono", r.args));
      if (r.parents || r.children) task.append(family(r));
      const status = el("span", "pill " + r.status, r.status);
      const attempts = cell(r.attempts + " / " + r.max_attempts + " ", "num"); attempts.append(status);
      const details = el("details", "error");
      const summary = el("summary", "", r.error ? r.error.split("\n")[0] : "(no error recorded)");
      const pre = el("pre", "mono");
      details.append(summary, pre);
      details.addEventListener("toggle", () => {
        if (details.open) { state.openErrors.add(r.id); loadError(r.id, pre); } else { state.openErrors.delete(r.id); }
      });
      if (state.openErrors.has(r.id)) { details.open = true; pre.textContent = state.fullErrors.get(r.id) || ""; }
      const errorCell = cell(""); errorCell.append(details);
      const when = cell(r.status === "dead" ? fmtAgo(-r.when) : r.when > 0 ? "retry in " + fmtSeconds(r.when) : "retry due now", "num");
      tr.append(jobCell(r.id), task, queueCell(r.queue), attempts, errorCell, when);
      return tr;
    }));
  }

  function renderSchedules(rows) {
    const body = $("schedules");
    if (!rows.length) { body.replaceChildren(emptyRow(6, "No schedules")); return; }
    body.replaceChildren(...rows.map((s) => {
      const tr = el("tr");
      const name = cell(s.name);
      if (s.paused || s.enabled === false) name.append(" ", el("span", "pill paused", s.paused ? "paused" : "disabled"));
      tr.append(name, cell(s.cron, "mono"), cell(s.task), queueCell(s.queue), cell(fmtRelative(s.next_run), "num"), cell(fmtRelative(s.last_run), "num"));
      return tr;
    }));
  }

  function renderRates(snap) {
    const r = snap.rates || {};
    setText("rate-insert", r.insert === null || r.insert === undefined ? "" : fmtRate(r.insert) + " jobs/s");
    setText("rate-claim", r.claim === null || r.claim === undefined ? "" : fmtRate(r.claim) + " jobs/s");
    const alive = r.heartbeat_workers || 0;
    setText("rate-heartbeat", alive ? alive + (alive === 1 ? " live worker" : " live workers") : "");
    // Arrows with traffic flow; idle ones stay still.
    $("edge-insert").classList.toggle("active", r.insert > 0);
    $("edge-notify").classList.toggle("active", r.insert > 0 && alive > 0);
    $("edge-claim").classList.toggle("active", r.claim > 0);
    $("edge-heartbeat").classList.toggle("active", alive > 0);
  }

  // Lease left and running-for move every 250 ms between snapshots, from the server's figures.
  function tick() {
    const dt = elapsed();
    for (const td of document.querySelectorAll("td.lease")) {
      const left = Number(td.dataset.base) - dt;
      td.textContent = left > 0 ? fmtSeconds(left) : "expired";
      td.classList.toggle("low", left < 5);
    }
    for (const td of document.querySelectorAll("td.running-for")) td.textContent = fmtSeconds(Number(td.dataset.base) + dt);
    for (const span of document.querySelectorAll(".workers .hb")) span.textContent = "heartbeat " + fmtSeconds(Number(span.dataset.age) + dt) + " ago";
    if (state.snap && state.snap.now) {
      const now = state.snap.now + dt;
      for (const span of document.querySelectorAll(".feed .ago")) span.textContent = fmtSeconds(Math.max(now - Number(span.dataset.at), 0)) + " ago";
    }
  }

  function render(snap) {
    if (snap.status !== "ok") {
      setConn("reconnecting", "reconnecting to the database…", snap.error);
      return;
    }
    setConn("live", "live");
    setText("conn-cost", snap.refresh_ms === null || snap.refresh_ms === undefined ? "" : "read in " + fmtSeconds(snap.refresh_ms / 1000));
    state.snap = snap;
    state.receivedAt = performance.now();
    document.body.dataset.refresh = String(snap.refresh);
    state.paused = new Set(snap.paused_queues || []);
    renderTiles(snap.tiles);
    renderThroughput(snap.throughput);
    renderDepth(snap.depth);
    renderWorkers(snap.workers, snap.late_after);
    renderFeed(snap.feed);
    renderRunning(snap.running);
    renderProblems(snap.problems, snap.problem_counts);
    renderSchedules(snap.schedules);
    renderRates(snap);
    tick();
  }

  function connect() {
    const source = new EventSource("events");
    source.onmessage = (event) => { try { render(JSON.parse(event.data)); } catch (err) { console.error(err); } };
    // EventSource reconnects by itself (the server asks for 2 s); the page is never reloaded.
    source.onerror = () => { setConn("reconnecting", "reconnecting to the dashboard…"); };
  }

  window.addEventListener("resize", () => {
    for (const chart of Object.values(state.charts)) if (chart) chart.setSize(chartSize(chart.root.parentElement));
  });

  document.addEventListener("DOMContentLoaded", () => {
    connect();
    setInterval(tick, 250);
  });
})();
