// pgqueue dashboard: renders the snapshots the server pushes over Server-Sent Events.
// Everything from the database is written with textContent, never as HTML.
(function () {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const state = { snap: null, receivedAt: 0, charts: {}, depthKey: "", legendKey: "", depthScale: null, depthValues: new Map(), problemsOpen: new Set(), paused: new Set(), queue: queueParam(), seenFeed: new Set(), openErrors: new Set(), fullErrors: new Map() };

  // The queue the Running and Problems panels are filtered to: ?queue= in the page's URL, so a
  // filtered view is bookmarkable. The filter runs here, on the pushed snapshot: the refresh is
  // shared by every open page and stays one read whatever each page shows.
  function queueParam() {
    const q = new URLSearchParams(window.location.search).get("queue");
    return q === null || q === "" ? null : q;
  }

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

  // --- keeping rows ----------------------------------------------------------------------
  // A refresh brings every list anew; rebuilding its rows would pull them out from under the
  // cursor (a click between mousedown and mouseup lost, a hover or a text selection gone).
  // Instead the rows already shown are kept and brought up to date: a row with a data-key keeps
  // its node while its key is listed, one without is matched by position. A row with listeners
  // must carry a key that decides what they do (they are kept with it).
  function sameKind(a, b) {
    return a.nodeType === b.nodeType && a.nodeName === b.nodeName
      && (a.nodeType !== 1 || a.dataset.key === b.dataset.key);
  }
  function morph(old, next) {
    // Styles are set through the CSSOM after a render (the CSP forbids style attributes): left alone.
    for (const { name } of [...old.attributes]) if (name !== "style" && !next.hasAttribute(name)) old.removeAttribute(name);
    for (const { name, value } of next.attributes) if (name !== "style" && old.getAttribute(name) !== value) old.setAttribute(name, value);
    const a = old.childNodes, b = next.childNodes;
    if (a.length !== b.length || [...a].some((n, i) => !sameKind(n, b[i]))) { old.replaceChildren(...b); return; }
    for (let i = 0; i < a.length; i++) {
      if (a[i].nodeType === 1) morph(a[i], b[i]);
      else if (a[i].nodeValue !== b[i].nodeValue) a[i].nodeValue = b[i].nodeValue;
    }
  }
  function patch(parent, nodes) {
    const keyed = new Map(), loose = [];
    for (const node of parent.children) if (node.dataset.key) keyed.set(node.dataset.key, node); else loose.push(node);
    let place = 0;  // rows without a key are matched in order among themselves
    const out = nodes.map((next) => {
      const old = next.dataset.key ? keyed.get(next.dataset.key) : loose[place++];
      if (!old || !sameKind(old, next)) return next;
      if (next.dataset.key) keyed.delete(next.dataset.key);
      morph(old, next);
      return old;
    });
    const kept = new Set(out);
    for (const node of [...parent.childNodes]) if (!kept.has(node)) node.remove();
    out.forEach((node, i) => { if (parent.children[i] !== node) parent.insertBefore(node, parent.children[i] || null); });
  }

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
  function fmtTick(v) {
    if (v === null || v === undefined) return "";
    const a = Math.abs(v);
    if (a >= 1e6) return +(v / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return +(v / 1e3).toFixed(0) + "k";
    if (a >= 1e3) return +(v / 1e3).toFixed(1) + "k";
    return String(+v.toFixed(2));
  }
  function fmtClock(t) { return new Date(t * 1000).toLocaleTimeString([], { hour12: false }); }
  // Both charts get the same axis sizes, so their plot areas line up side by side.
  function axes(unit) {
    const ink = cssVar("--muted"), grid = cssVar("--line");
    const common = { stroke: ink, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
    const clock = (u, ticks) => ticks.map(fmtClock);
    return [Object.assign({}, common, { values: clock, space: 70, size: 40 }),
            Object.assign({}, common, { size: 44, label: unit, labelSize: 16, labelFont: "11px system-ui, sans-serif",
                                        values: (u, ticks) => ticks.map(fmtTick) })];
  }
  // Log scale ticks: 0 and the powers of ten, nothing else (uPlot's own add a -1 and every 2, 5).
  function logAxes() {
    const both = axes("jobs (log)");
    both[1].splits = (u, axisIdx, min, max) => {
      const out = [0];
      for (let v = 1; v <= max; v *= 10) out.push(v);
      return out;
    };
    return both;
  }
  // A value with nothing next to it would be invisible as a line: draw it as a dot (the first
  // second a dashboard sees, with no worker sampling before it).
  function lonePoints(u, seriesIdx) {
    const ys = u.data[seriesIdx], out = [];
    for (let i = 0; i < ys.length; i++) {
      if (ys[i] !== null && ys[i] !== undefined && (i === 0 || ys[i - 1] === null) && (i === ys.length - 1 || ys[i + 1] === null)) out.push(i);
    }
    return out;
  }
  // The figures under the cursor, or the latest ones when it is elsewhere: the legend is live.
  function readoutIndex(u, latest) {
    const idx = u.cursor.idx;
    return idx === null || idx === undefined ? latest(u) : idx;
  }
  function lastKnown(u) {
    for (let i = u.data[0].length - 1; i >= 0; i--) {
      for (let s = 1; s < u.data.length; s++) if (u.data[s][i] !== null && u.data[s][i] !== undefined) return i;
    }
    return u.data[0].length - 1;
  }
  function fmtValue(v, fmt) { return v === null || v === undefined ? "–" : fmt(v); }

  function throughputReadout(u) {
    const i = readoutIndex(u, lastKnown);
    const total = u.data[1][i], ok = u.data[2][i];
    setText("tp-ok", fmtValue(ok, fmtRate));
    setText("tp-bad", fmtValue(total === null || ok === null ? null : total - ok, fmtRate));
    setText("tp-at", "jobs/s at " + fmtClock(u.data[0][i]));
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
        axes: axes("jobs/s"),
        hooks: { setCursor: [throughputReadout], setData: [throughputReadout] },
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

  // A queue keeps its colour whatever other queues come and go: it is a hash of its name
  // (FNV-1a) into the palette, not its place in the list.
  const PALETTE_SIZE = 10;
  function queueColour(name) {
    let h = 0x811c9dc5;
    for (let i = 0; i < name.length; i++) { h ^= name.charCodeAt(i); h = Math.imul(h, 0x01000193); }
    return cssVar("--q" + (((h >>> 0) % PALETTE_SIZE) + 1));
  }

  // Log scale (arcsinh: linear near 0, so empty seconds still sit on the axis) when one queue
  // dwarfs another, unless the reader picked a scale.
  function depthScale(depth) {
    if (state.depthScale) return state.depthScale;
    const peaks = Object.values(depth.queues).map((v) => Math.max(0, ...v.filter((x) => x !== null))).filter((p) => p > 0);
    return peaks.length > 1 && Math.max(...peaks) >= 10 * Math.min(...peaks) ? "log" : "linear";
  }

  function depthReadout(u) {
    const i = readoutIndex(u, lastKnown);
    const hovering = u.cursor.idx !== null && u.cursor.idx !== undefined;
    for (let s = 1; s < u.series.length; s++) {
      const node = state.depthValues.get(u.series[s].label);
      if (node) { const text = fmtValue(u.data[s][i], fmtInt); if (node.textContent !== text) node.textContent = text; }
    }
    setText("depth-at", "jobs waiting " + (hovering ? "at " + fmtClock(u.data[0][i]) : "now"));
  }

  function renderDepth(depth) {
    const names = Object.keys(depth.queues);
    $("depth-empty").hidden = names.length > 0;
    $("chart-depth").hidden = names.length === 0;
    const scale = depthScale(depth);
    for (const button of document.querySelectorAll("#depth-scale button")) {
      button.setAttribute("aria-pressed", String(button.dataset.scale === scale));
    }
    const key = names.join("\u0000") + "\u0002" + scale;
    if (key !== state.depthKey) {
      state.depthKey = key;
      if (state.charts.depth) { state.charts.depth.destroy(); state.charts.depth = null; }
    }
    // Paused queues with nothing waiting have no line, but are still named (without a colour key).
    const idle = [...state.paused].filter((n) => !(n in depth.queues));
    const legendKey = key + "\u0001" + [...state.paused].join("\u0000");
    if (legendKey !== state.legendKey) {
      state.legendKey = legendKey;
      state.depthValues = new Map();
      const at = el("span", "at");
      at.id = "depth-at";
      $("depth-legend").replaceChildren(
        ...names.map((n) => {
          const item = el("span", "item");
          const swatch = el("span", "key");
          swatch.dataset.queue = n;
          const value = el("b", "val", "");
          state.depthValues.set(n, value);
          item.append(swatch, queueName(n, "qname"), value);
          return item;
        }),
        ...idle.map((n) => queueName(n, "qname idle")), at);
      // Colours go through the CSSOM (allowed by the CSP), never through style attributes.
      for (const swatch of document.querySelectorAll("#depth-legend .key")) swatch.style.background = queueColour(swatch.dataset.queue);
    }
    if (!window.uPlot || names.length === 0) return;
    const data = [depth.t, ...names.map((n) => depth.queues[n])];
    if (!state.charts.depth) {
      const node = $("chart-depth");
      const y = scale === "log"
        ? { distr: 4, log: 10, asinh: 1, range: (u, min, max) => [0, Math.max(max, 10) * 1.5] }
        : { range: (u, min, max) => [0, Math.max(max, 1) * 1.1] };
      state.charts.depth = new window.uPlot(Object.assign(chartSize(node), {
        legend: { show: false }, cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true }, y },
        axes: scale === "log" ? logAxes() : axes("jobs"),
        hooks: { setCursor: [depthReadout], setData: [depthReadout] },
        series: [{}, ...names.map((n) => ({ label: n, stroke: queueColour(n), width: 2,
                                           points: { show: true, size: 5, fill: queueColour(n), filter: lonePoints } }))],
      }), data, node);
    } else {
      state.charts.depth.setData(data);
    }
  }

  // --- lists -----------------------------------------------------------------------------
  function renderWorkers(workers, lateAfter) {
    $("workers-empty").hidden = workers.length > 0;
    patch($("workers"), workers.map((w) => {
      const li = el("li", w.late ? "late" : "");
      li.dataset.key = w.id;
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
    if (!feed.length) { patch(list, [el("li", "empty", "Waiting for jobs…")]); return; }
    const first = state.seenFeed.size === 0;
    const seen = new Set();
    patch(list, feed.map((e) => {
      const key = e.id + ":" + e.event + ":" + e.at;
      seen.add(key);
      const li = el("li", !first && !state.seenFeed.has(key) ? "new" : "");
      li.dataset.key = key;
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

  function renderRunning(rows, queue, total) {
    const body = $("running");
    // The snapshot lists the longest-running jobs of every queue; a queue's may be past them.
    const note = queue !== null && total > rows.length
      ? [filterNote(7, "showing " + fmtInt(rows.length) + " of its " + fmtInt(total) + ": the dashboard lists the " + LIST_LIMIT + " longest-running jobs across every queue")]
      : [];
    if (!rows.length) { patch(body, [emptyRow(7, queue === null ? "Nothing is running right now" : "Nothing of queue " + queue + " is running right now"), ...note]); return; }
    patch(body, [...note, ...rows.map((r) => {
      const tr = el("tr");
      tr.dataset.key = "job:" + r.id;
      const task = cell(r.task); task.append(el("span", "args mono", r.args));
      if (r.progress) task.append(progressBar(r.progress));
      if (r.parents || r.children) task.append(family(r));
      const running = cell("", "num running-for"); running.dataset.base = String(r.running_for);
      const lease = cell("", "num lease"); lease.dataset.base = String(r.lease_left);
      tr.append(jobCell(r.id), task, queueCell(r.queue), cell(shortId(r.worker), "mono"),
        cell(r.attempt + " / " + r.max_attempts, "num"), running, lease);
      return tr;
    })]);
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

  function problemRow(r) {
    const tr = el("tr", r.status);
    tr.dataset.job = String(r.id);
    tr.dataset.key = "job:" + r.id + ":" + r.status;
    const task = cell(r.task); task.append(el("span", "args mono", r.args));
    if (r.parents || r.children) task.append(family(r));
    const status = el("span", "pill " + r.status, r.status);
    const attempts = cell(r.attempts + " / " + r.max_attempts + " ", "num"); attempts.append(status);
    const details = el("details", "error");
    const summary = el("summary", "", r.error ? r.error.split("\n")[0] : "(no error recorded)");
    const pre = el("pre", "mono");
    details.append(summary, pre);
    // Remembered at the click: the toggle event comes a task later, and a refresh in between
    // would rebuild the row closed (the screenshot script lost its open error that way).
    summary.addEventListener("click", () => { if (details.open) state.openErrors.delete(r.id); else state.openErrors.add(r.id); });
    details.addEventListener("toggle", () => {
      if (details.open) { state.openErrors.add(r.id); loadError(r.id, pre); } else { state.openErrors.delete(r.id); }
    });
    if (state.openErrors.has(r.id)) { details.open = true; pre.textContent = state.fullErrors.get(r.id) || ""; }
    const errorCell = cell(""); errorCell.append(details);
    const when = cell(r.status === "dead" ? fmtAgo(-r.when) : r.when > 0 ? "retry in " + fmtSeconds(r.when) : "retry due now", "num");
    tr.append(jobCell(r.id), task, queueCell(r.queue), attempts, errorCell, when);
    return tr;
  }

  // Dead and retrying jobs in two groups, each with its count and its first rows, so many dead
  // jobs never push the retrying ones out of sight; the rest is one click away. No scroll box:
  // a row is never cut in half.
  const PROBLEM_ROWS = 5;
  const PROBLEM_GROUPS = [["dead", "Dead", "newest", "No dead jobs"], ["retrying", "Retrying", "soonest", "Nothing waits for a retry"]];
  function renderProblems(rows, counts) {
    setText("problem-counts", counts ? "· " + fmtInt(counts.dead) + " dead · " + fmtInt(counts.retrying) + " retrying" : "");
    const body = $("problems");
    if (!rows.length && !(counts && (counts.dead || counts.retrying))) { patch(body, [emptyRow(6, "Nothing here")]); return; }
    const out = [];
    for (const [status, label, order, none] of PROBLEM_GROUPS) {
      const group = rows.filter((r) => r.status === status);
      const total = counts ? counts[status] : group.length;
      const head = el("tr", "group " + status);
      const th = el("th", "", "");
      th.colSpan = 6;
      th.append(el("span", "pill " + status, label), " ", el("span", "group-count", fmtInt(total)));
      head.append(th);
      out.push(head);
      if (!group.length) {
        // A filtered queue's jobs can all be past the newest / soonest listed across queues.
        out.push(total > 0 ? filterNote(6, "none of its " + fmtInt(total) + " is among the " + LIST_LIMIT + " " + order + " listed across every queue") : emptyRow(6, none));
        continue;
      }
      const open = state.problemsOpen.has(status);
      const shown = open ? group : group.slice(0, PROBLEM_ROWS);
      out.push(...shown.map(problemRow));
      const parts = [];
      if (total > shown.length) parts.push(el("span", "muted", "the " + order + " " + fmtInt(shown.length) + " of " + fmtInt(total) + " "));
      if (group.length > PROBLEM_ROWS) {
        const button = el("button", "more", open ? "show fewer" : "show " + fmtInt(group.length - shown.length) + " more");
        button.type = "button";
        button.addEventListener("click", () => {
          if (open) state.problemsOpen.delete(status); else state.problemsOpen.add(status);
          if (state.snap) { renderLists(); markOverflow(); }
        });
        parts.push(button);
      }
      if (parts.length) { const tr = el("tr", "more-row"); tr.dataset.key = "more:" + status + ":" + open; const td = cell(""); td.colSpan = 6; td.append(...parts); tr.append(td); out.push(tr); }
    }
    patch(body, out);
  }

  // A table wider than its box scrolls sideways: say so (a shade and a hint on that side).
  function markOverflow() {
    for (const box of document.querySelectorAll(".scroll")) {
      const more = [];
      if (box.scrollLeft > 1) more.push("left");
      if (box.scrollLeft + box.clientWidth < box.scrollWidth - 1) more.push("right");
      const value = more.join(" ");
      if (box.dataset.more !== value) box.dataset.more = value;
    }
  }

  const LIST_LIMIT = 50;  // queries.LIST_LIMIT: rows per list in a snapshot
  function filterNote(cols, text) { const tr = el("tr", "filter-note"); const td = cell(text); td.colSpan = cols; tr.append(td); return tr; }

  // Running jobs and Problems, all queues or the one in ?queue=; the counts are then the queue's.
  function renderLists() {
    const snap = state.snap, queue = state.queue;
    const keep = (r) => queue === null || r.queue === queue;
    const row = queue === null ? null : (snap.queues || []).find((r) => r.queue === queue) || null;
    renderRunning(snap.running.filter(keep), queue, row ? row.running : 0);
    const counts = queue === null ? snap.problem_counts : { dead: row ? row.dead : 0, retrying: row ? row.retrying : 0 };
    renderProblems(snap.problems.filter(keep), counts);
    for (const chip of document.querySelectorAll("h2 .filter")) {
      chip.hidden = queue === null;
      chip.querySelector(".filter-name").textContent = queue === null ? "" : queue;
      chip.querySelector(".filter-clear").href = window.location.pathname;
    }
    for (const tr of document.querySelectorAll("#queues tr[data-queue]")) tr.classList.toggle("selected", tr.dataset.queue === queue);
  }

  function setQueue(queue) {
    state.queue = queue;
    const url = new URL(window.location.href);
    if (queue === null) url.searchParams.delete("queue"); else url.searchParams.set("queue", queue);
    window.history.pushState(null, "", url);
    if (state.snap) { renderLists(); markOverflow(); }
  }

  function limitPills(r) {
    const out = [];
    if (r.limit !== null && r.limit !== undefined) {
      const pill = el("span", "pill limited", "limit " + r.limit);
      pill.title = "At most " + r.limit + " of its jobs run at once across every worker (pgqueue queues limit).";
      out.push(" ", pill);
    }
    if (r.rate_limit !== null && r.rate_limit !== undefined) {
      const used = r.rate_used === null || r.rate_used === undefined ? "" : " · " + fmtInt(r.rate_used) + " used";
      const pill = el("span", "pill limited", "rate " + r.rate_limit + " / " + fmtSeconds(r.rate_period) + used);
      pill.title = "At most " + r.rate_limit + " of its jobs start in any " + fmtSeconds(r.rate_period) + " (pgqueue queues limit).";
      out.push(" ", pill);
    }
    return out;
  }

  function renderQueues(rows) {
    const body = $("queues");
    if (!rows.length) { patch(body, [emptyRow(10, "No queues yet")]); return; }
    patch(body, rows.map((r) => {
      const tr = el("tr", r.queue === state.queue ? "selected" : "");
      tr.dataset.queue = r.queue;
      tr.dataset.key = "queue:" + r.queue;
      const link = el("a", "queue-link", r.queue);
      link.href = "?queue=" + encodeURIComponent(r.queue);
      link.title = "Show only this queue's running jobs and problems";
      const name = cell("");
      name.append(link);
      if (r.paused) { const pill = el("span", "pill paused", "paused"); pill.title = "Paused: no worker claims its jobs until `pgqueue queues resume`."; name.append(" ", pill); }
      name.append(...limitPills(r));
      const waiting = r.queued + r.retrying;
      const oldest = r.oldest === null || r.oldest === undefined ? "–" : r.oldest >= 0 ? fmtSeconds(r.oldest) : "next in " + fmtSeconds(-r.oldest);
      const ids = r.workers.slice(0, 3).map(shortId).join(", ") + (r.workers.length > 3 ? ", …" : "");
      const workers = cell(r.workers.length ? r.workers.length + " · " + ids : "none", r.workers.length || !waiting ? "mono" : "mono none");
      workers.title = r.workers.join("\n");
      const why = cell(r.why ? r.why.text : "", "queue-why");
      if (r.why) why.dataset.code = r.why.code;
      tr.append(name, cell(fmtInt(r.queued), "num"), cell(fmtInt(r.running), "num"), cell(fmtInt(r.retrying), "num"),
        cell(fmtInt(r.dead), "num" + (r.dead ? " dead" : "")), cell(fmtRate(r.rate), "num"),
        cell(fmtValue(r.pickup_p95, fmtSeconds), "num"), cell(oldest, "num"), workers, why);
      return tr;
    }));
  }

  // What slows every claim, hidden when nothing is wrong.
  function renderHealth(h, threshold) {
    const items = [];
    const item = (cls, ...parts) => { const li = el("li", cls); li.append(...parts); items.push(li); };
    if (h && h.transaction) {
      const t = h.transaction;
      const what = [t.application_name ? "“" + t.application_name + "”" : "no application_name", t.state || "state unknown"];
      const query = t.query ? " Its last query (started " + fmtAgo(t.query_age) + "): " : "";
      item("warn", el("b", "", "A transaction has been open for " + fmtSeconds(t.age)),
        " (over " + fmtSeconds(threshold) + ") and holds back vacuum: ", el("code", "", "pid " + t.pid),
        " · " + what.join(" · ") + "." + query, t.query ? el("code", "", t.query) : "",
        t.query ? "." : "", " Dead rows in pgqueue_jobs cannot be removed while it lasts, and every claim reads past them: end it (", el("code", "", "pg_terminate_backend(" + t.pid + ")"), " if it is forgotten).");
    }
    if (h && h.dead_rows) {
      const d = h.dead_rows;
      const pct = d.live ? Math.round(100 * d.dead / d.live) + " % of" : "against";
      const vacuumed = d.vacuumed_ago === null || d.vacuumed_ago === undefined ? "never vacuumed since the statistics were reset" : "last vacuumed " + fmtAgo(d.vacuumed_ago);
      item("warn", el("b", "", "pgqueue_jobs holds " + fmtInt(d.dead) + " dead rows"), ", " + pct + " its " + fmtInt(d.live) + " live ones; " + vacuumed + ". Autovacuum is behind or held back (an old transaction, a replication slot, a prepared transaction).");
    }
    for (const w of (h && h.workers) || []) {
      const every = w.interval ? "it beats about every " + fmtSeconds(w.interval) + " (a third of its lease)" : "it has no lease recorded";
      item("warn", el("b", "", "Worker " + shortId(w.id) + " (" + w.host + ", pid " + w.pid + ") is behind its heartbeat"), ": the last one was " + fmtAgo(w.heartbeat_age) + ", and " + every + ".");
    }
    const warnings = items.length;
    if (h && h.hidden_sessions) {
      item("note", fmtInt(h.hidden_sessions) + (h.hidden_sessions === 1 ? " session" : " sessions") + " of other roles cannot be seen by this dashboard's role, so a transaction of theirs holding back vacuum cannot be named: ", el("code", "", "GRANT pg_read_all_stats TO <dashboard role>"), ".");
    }
    const strip = $("health");
    strip.hidden = items.length === 0;
    strip.classList.toggle("quiet", warnings === 0);
    setText("health-title", warnings ? "Needs a look:" : "Note:");
    patch($("health-list"), items);
  }

  function renderSchedules(rows) {
    const body = $("schedules");
    if (!rows.length) { patch(body, [emptyRow(6, "No schedules")]); return; }
    patch(body, rows.map((s) => {
      const tr = el("tr");
      tr.dataset.key = "schedule:" + s.name;
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

  // The role can write (a superuser, or INSERT/UPDATE/DELETE grants): say so, once per page.
  function renderWritable(tables) {
    $("writable").hidden = tables.length === 0;
    setText("writable-text", tables.length === 0 ? "" : tables[0] === "*"
      ? "It is a superuser."
      : "It may change " + tables.join(", ") + ".");
  }

  function render(snap) {
    if (snap.status !== "ok") {
      setConn("reconnecting", "reconnecting to the database…", snap.error);
      return;
    }
    setConn("live", "live");
    setText("conn-cost", snap.refresh_ms === null || snap.refresh_ms === undefined ? "" : "read in " + fmtSeconds(snap.refresh_ms / 1000));
    // A hot standby: its figures are as old as its replay.
    const replica = snap.replica;
    setText("conn-replica", !replica ? "" : replica.lag === null ? "replica, lag unknown"
      : "replica, " + (replica.lag < 1 ? "< 1 s" : fmtSeconds(replica.lag)) + " behind");
    state.snap = snap;
    state.receivedAt = performance.now();
    document.body.dataset.refresh = String(snap.refresh);
    state.paused = new Set(snap.paused_queues || []);
    renderWritable(snap.writable || []);
    renderTiles(snap.tiles);
    renderThroughput(snap.throughput);
    renderDepth(snap.depth);
    renderHealth(snap.health, snap.long_transaction);
    renderQueues(snap.queues || []);
    renderWorkers(snap.workers, snap.late_after);
    renderFeed(snap.feed);
    renderLists();
    renderSchedules(snap.schedules);
    renderRates(snap);
    markOverflow();
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
    markOverflow();
  });
  document.addEventListener("scroll", markOverflow, true);  // scroll does not bubble: capture

  document.addEventListener("DOMContentLoaded", () => {
    for (const button of document.querySelectorAll("#depth-scale button")) {
      button.addEventListener("click", () => {
        state.depthScale = button.dataset.scale;
        if (state.snap) renderDepth(state.snap.depth);
      });
    }
    // A queue's row (or its name, a plain ?queue= link) filters; its selected row clears.
    $("queues").addEventListener("click", (event) => {
      const tr = event.target.closest("tr[data-queue]");
      if (!tr || event.metaKey || event.ctrlKey || event.shiftKey) return;
      event.preventDefault();
      setQueue(state.queue === tr.dataset.queue ? null : tr.dataset.queue);
    });
    for (const clear of document.querySelectorAll("h2 .filter-clear")) {
      clear.addEventListener("click", (event) => { event.preventDefault(); setQueue(null); });
    }
    window.addEventListener("popstate", () => {
      state.queue = queueParam();
      if (state.snap) { renderLists(); markOverflow(); }
    });
    connect();
    setInterval(tick, 250);
  });
})();
