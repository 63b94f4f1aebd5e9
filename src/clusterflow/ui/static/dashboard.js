// clusterflow dashboard: renders what the server streams (server-sent events) and keeps
// the charts' points in the browser; the server holds no history. No framework: text
// goes in through textContent only, so nothing a job prints can become markup.
"use strict";

const cf = (() => {
  const FIGURES = [["step", "step"], ["samples_per_s", "samples/s"], ["loss", "loss"]];
  const TERMINAL = ["succeeded", "failed", "stopped"];
  const MAX_POINTS = 3600; // an hour at one point a second
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

  const num = (v, digits) => (v === null || v === undefined ? "-" :
    (Number.isInteger(v) ? String(v) : Number(v).toPrecision(digits || 4)));
  function bytes(v) {
    if (!v) return "-";
    if (v >= 2 ** 30) return (v / 2 ** 30).toFixed(1) + " GiB";
    return v >= 2 ** 20 ? (v / 2 ** 20).toFixed(0) + " MiB" : (v / 1024).toFixed(0) + " KiB";
  }
  const clock = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "-");
  function age(s) {
    if (s === null || s === undefined) return "-";
    s = Math.floor(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    return h ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(r).padStart(2, "0")}s`;
  }

  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }
  function row(cells) {
    const tr = document.createElement("tr");
    cells.forEach((c) => tr.appendChild(c instanceof Node ? c : cell(String(c))));
    return tr;
  }
  function fill(tableId, rows, empty) {
    const body = document.querySelector(`#${tableId} tbody`);
    body.replaceChildren(...rows);
    if (!rows.length && empty) {
      const td = cell(empty);
      td.colSpan = body.parentElement.querySelectorAll("th").length;
      body.appendChild(row([td]));
    }
  }
  function statusCell(status) {
    const td = document.createElement("td");
    const span = document.createElement("span");
    span.textContent = status;
    span.className = `status s-${status}`;
    td.appendChild(span);
    return td;
  }
  function link(href, text) {
    const a = document.createElement("a");
    a.href = href; a.textContent = text;
    const td = document.createElement("td"); td.appendChild(a);
    return td;
  }

  function stream(url, onData, onGone) {
    const live = document.getElementById("live");
    const source = new EventSource(url);
    source.onopen = () => live.classList.add("on");
    source.onerror = () => live.classList.remove("on");
    source.onmessage = (e) => onData(JSON.parse(e.data));
    source.addEventListener("gone", () => { source.close(); if (onGone) onGone(); });
    return source;
  }

  // The cluster list ----------------------------------------------------------------
  function renderList(rows) {
    fill("clusters", rows.map((c) => {
      const tr = row([
        link(`/clusters/${encodeURIComponent(c.id)}`, c.id),
        statusCell(c.status),
        cell(c.tasks === undefined ? "-" : `${c.running}/${c.tasks}`),
        cell(c.restarts === undefined ? "-" : String(c.restarts), "num"),
        cell(age(c.age_s), "num"),
        cell(num(c.step), "num"),
        cell(c.samples_per_s == null ? "-" : c.samples_per_s.toFixed(0), "num"),
        cell(c.command || c.summary || "", "cmd"),
      ]);
      tr.dataset.id = c.id;
      return tr;
    }), "no clusters yet: clusterflow start ...");
  }
  function listPage() {
    stream("/api/clusters/stream", renderList);
  }

  // Charts: one per figure, one series per task -------------------------------------
  // Tick labels with as many decimals as the step between two ticks needs: uPlot's
  // default keeps three, so a loss between 2.3290 and 2.3292 showed "2.329" on every tick.
  function tickLabels(u, splits, axisIdx, space, incr) {
    let step = incr || 0;
    for (let i = 1; !step && i < splits.length; i++) step = Math.abs(splits[i] - splits[i - 1]);
    let digits = 0;
    while (step && digits < 15) {
      const scaled = step * 10 ** digits;
      if (Math.abs(Math.round(scaled) - scaled) <= 1e-6 * Math.max(1, scaled)) break;
      digits++;
    }
    const largest = Math.max(...splits.map((v) => Math.abs(v || 0)));
    return splits.map((v) => {
      if (v === null || v === undefined) return "";
      if (digits <= 6) return v.toFixed(digits);
      // Tiny steps: as many significant digits as the step needs, in exponent form.
      const lead = largest ? Math.floor(Math.log10(largest)) : 0;
      return v.toExponential(Math.min(14, Math.max(1, digits + lead)));
    });
  }
  const yAxis = (label) => ({ label, size: 60, values: tickLabels });

  const charts = {};
  let lastCheckpoints = [];
  class FigureChart {
    constructor(key, label) {
      this.key = key; this.label = label; this.tasks = []; this.data = [[]]; this.plot = null;
      this.box = document.getElementById(`chart-${key}`);
    }
    build() {
      if (this.plot) this.plot.destroy();
      const width = Math.max(320, this.box.clientWidth - 16);
      const series = [{}].concat(this.tasks.map((t, i) => ({
        label: t, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
      })));
      this.plot = new uPlot({ width, height: 200, series, scales: { x: { time: true } },
        axes: [{}, yAxis(this.label)] }, this.data, this.box);
    }
    add(time, tasks) {
      const names = tasks.map((t) => t.task);
      if (names.join() !== this.tasks.join()) {
        const old = this.tasks;
        this.data = [this.data[0]].concat(names.map((n) => {
          const i = old.indexOf(n);
          return i >= 0 ? this.data[i + 1] : this.data[0].map(() => null);
        }));
        this.tasks = names;
        this.build();
      }
      this.data[0].push(time);
      tasks.forEach((t, i) => this.data[i + 1].push(t[this.key] === undefined ? null : t[this.key]));
      if (this.data[0].length > MAX_POINTS) this.data.forEach((s) => s.shift());
      this.plot.setData(this.data);
    }
    last(task) {
      const i = this.tasks.indexOf(task);
      if (i < 0) return null;
      const s = this.data[i + 1];
      for (let j = s.length - 1; j >= 0; j--) if (s[j] !== null) return s[j];
      return null;
    }
  }

  // One cluster ---------------------------------------------------------------------
  function renderCluster(c) {
    if (c.error) { document.getElementById("summary").textContent = c.error; return; }
    const status = document.getElementById("status");
    status.textContent = c.status;
    status.className = `status s-${c.status}`;
    const summary = document.getElementById("summary");
    summary.textContent = c.summary ? `${c.summary} (exit code ${c.exit_code})` : "";
    summary.className = `summary s-${c.status}`;
    document.getElementById("age").textContent = age(c.age_s);
    document.getElementById("restarts").textContent =
      c.max_restarts ? `${c.restarts} of ${c.max_restarts}` : String(c.restarts);
    document.getElementById("tensorboard").textContent =
      c.tensorboard_dir || "- (no Summary hook yet)";
    document.getElementById("stop").disabled = TERMINAL.includes(c.status);
    document.getElementById("spec").textContent = c.spec ? JSON.stringify(c.spec, null, 1) : "-";
    document.getElementById("spec-version").textContent = c.spec ? `version ${c.spec_version}` : "";

    fill("tasks", c.tasks.map((t) => {
      const tr = row([
        cell(t.task), cell(t.node), statusCell(t.status), cell(num(t.step), "num"),
        cell(t.samples_per_s == null ? "-" : t.samples_per_s.toFixed(1), "num"),
        cell(num(t.loss), "num"), cell(bytes(t.memory_requested), "num"),
        cell(bytes(t.memory_measured), "num"), cell(String(t.restarts), "num"),
      ]);
      tr.dataset.task = t.task;
      return tr;
    }), "no tasks yet");

    if (c.membership) renderMembership(c.membership);

    // A point a second while the cluster runs (a flat line is a stall); none after it ended.
    const ended = TERMINAL.includes(c.status);
    const now = Date.now() / 1000;
    if (!ended || !charts.step.data[0].length) FIGURES.forEach(([key]) => charts[key].add(now, c.tasks));

    // Splits of the epoch shown: acknowledged + leased + pending = splits. Leases of
    // the next epochs (lent before this one ends) are counted apart.
    fill("data", (c.data || []).map((d) => row([
      cell(d.dataset), cell(String(d.epoch) + (d.finished ? " (finished)" : ""), "num"),
      cell(String(d.splits), "num"), cell(String(d.acked), "num"),
      cell(String(d.leased), "num"), cell(String(d.pending), "num"),
      cell(String(d.leased_ahead), "num"),
    ])), "no dataset registered with the data service");
    if (c.checkpoints) {
      // The folder is named only once it holds a committed checkpoint.
      document.getElementById("checkpoint-dir").textContent =
        c.checkpoints.length ? c.checkpoint_dir : "- (no checkpoint committed yet)";
      fill("checkpoints", c.checkpoints.slice().reverse().map((k) => row([
        cell(String(k.step), "num"), cell(clock(k.created)), cell(String(k.parts), "num"),
        cell(bytes(k.bytes), "num"), cell(k.directory),
      ])), "no checkpoint committed yet");
    }
    // The timeline: the manager's events, and each committed checkpoint at its time.
    if (c.checkpoints) lastCheckpoints = c.checkpoints;
    const committed = lastCheckpoints.map((k) => ({ time: k.created, event: "checkpoint", step: k.step }));
    const timeline = c.events.concat(committed).sort((a, b) => (a.time || 0) - (b.time || 0));
    fill("events", timeline.reverse().map((e) => {
      const rest = Object.entries(e).filter(([k]) => k !== "time" && k !== "event")
        .map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ");
      return row([cell(clock(e.time)), cell(e.event || "?"), cell(rest, "cmd")]);
    }), "no events yet");
    renderLogs(c.logs || {});
  }

  // The worker job's size now and who joined and left it, newest first (issue 32).
  function renderMembership(m) {
    document.getElementById("workers-size").textContent =
      `${m.workers} worker${m.workers === 1 ? "" : "s"}, ` +
      (m.range ? `elastic ${m.range[0]}:${m.range[1]}` : "fixed size");
    fill("membership", m.history.map((h) => {
      const tr = row([
        cell(clock(h.time)), cell(h.task), cell(h.change), cell(num(h.step), "num"),
        cell(String(h.spec_version), "num"), cell(String(h.workers), "num"),
      ]);
      tr.dataset.task = h.task;
      return tr;
    }), m.range ? "no worker joined or left yet" : "a fixed size: scale does not resize it");
  }

  function renderLogs(logs) {
    const box = document.getElementById("logs");
    Object.entries(logs).forEach(([task, text]) => {
      let pre = box.querySelector(`pre[data-task="${CSS.escape(task)}"]`);
      if (!pre) {
        const details = document.createElement("details");
        details.open = true;
        const summary = document.createElement("summary");
        summary.textContent = task;
        pre = document.createElement("pre");
        pre.dataset.task = task;
        details.append(summary, pre);
        box.appendChild(details);
      }
      if (pre.textContent === text) return;
      // Follow the tail unless the reader scrolled up to read something.
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      pre.textContent = text;
      if (atEnd) pre.scrollTop = pre.scrollHeight;
    });
  }

  function stopButton(id, token) {
    const button = document.getElementById("stop");
    const outcome = document.getElementById("stop-outcome");
    button.addEventListener("click", async () => {
      const key = token || window.prompt("The dashboard's token (printed by `clusterflow ui`):");
      if (!key) return;
      button.disabled = true;
      outcome.textContent = "stopping...";
      const reply = await fetch(`/clusters/${encodeURIComponent(id)}/stop`, {
        method: "POST", headers: { Authorization: `Bearer ${key}` },
      });
      const body = await reply.json().catch(() => ({}));
      outcome.textContent = reply.ok ? body.outcome : `refused: ${body.error || reply.status}`;
      if (!reply.ok) button.disabled = false;
    });
  }

  function clusterPage(id, token, intervalMs) {
    FIGURES.forEach(([key, label]) => { charts[key] = new FigureChart(key, label); });
    renderCluster(JSON.parse(document.getElementById("initial").textContent));
    stopButton(id, token);
    stream(`/api/clusters/${encodeURIComponent(id)}/stream`, renderCluster, () => {
      document.getElementById("summary").textContent = "this cluster's folder is gone";
    });
  }

  return {
    listPage, clusterPage, charts, yAxis, renderMembership, lastPoint: (key, task) => charts[key].last(task),
  };
})();
window.cf = cf;
