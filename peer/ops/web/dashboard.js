// murmur dashboard: reads /api/state every few seconds and draws the run. No script from anywhere else.
"use strict";

// What a test (or a curious operator) can read from the console: script errors, renders, points drawn.
window.murmur = { errors: [], renders: 0, points: {} };
window.addEventListener("error", (e) => window.murmur.errors.push(String(e.message || e)));
window.addEventListener("unhandledrejection", (e) => window.murmur.errors.push(String(e.reason)));

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
const $ = (id) => document.getElementById(id);

function short(peerId) { return peerId.slice(-8); }

function fmtNumber(x, digits = 3) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "—";
  if (Math.abs(x) >= 1e4) return x.toLocaleString("en-US", { maximumFractionDigits: 0 });
  return Number(x.toPrecision(digits)).toString();
}

function fmtBytes(x) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "—";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let k = 0;
  while (Math.abs(x) >= 1000 && k < units.length - 1) { x /= 1000; k += 1; }
  return `${k === 0 ? x.toFixed(0) : x.toFixed(x < 10 ? 2 : 1)} ${units[k]}`;
}

function fmtClock(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}

// Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.
function niceTicks(lo, hi, count) {
  const span = hi - lo;
  const raw = span / Math.max(1, count);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || 10 * power;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
  return ticks;
}

// Draw lines [{label, color, xs, ys}] (x: unix seconds; a null y breaks the line) on a canvas.
// Returns how many points were drawn.
function drawChart(canvas, lines, options = {}) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 420, height = canvas.clientHeight || 240;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.fillStyle = "#fff";
  g.fillRect(0, 0, width, height);
  g.font = "11px system-ui, sans-serif";

  const finite = (v) => typeof v === "number" && Number.isFinite(v);
  let xmin = Infinity, xmax = -Infinity, ymin = Infinity, ymax = -Infinity, points = 0;
  for (const line of lines) {
    line.xs.forEach((x, i) => {
      const y = line.ys[i];
      if (!finite(x) || !finite(y)) return;
      xmin = Math.min(xmin, x); xmax = Math.max(xmax, x);
      ymin = Math.min(ymin, y); ymax = Math.max(ymax, y);
      points += 1;
    });
  }
  if (points === 0) {
    g.fillStyle = "#6a737d";
    g.fillText(options.empty || "no data yet", 12, 20);
    return 0;
  }
  if (options.zero) ymin = Math.min(0, ymin);
  if (ymax - ymin < 1e-12) {
    const d = Math.abs(ymax) * 0.05 || 1;
    if (options.zero && ymin >= 0) ymax += d; else { ymin -= d; ymax += d; }
  }
  if (xmax - xmin < 1) { xmin -= 30; xmax += 30; }
  const yticks = niceTicks(ymin, ymax, 4);
  ymin = Math.min(ymin, yticks[0]);
  ymax = Math.max(ymax, yticks[yticks.length - 1]);

  const legend = lines.filter((l) => l.label).slice(0, 8);
  const pad = { left: 60, right: 12, top: 8, bottom: 22 + (legend.length ? 18 : 0) };
  const px = (x) => pad.left + ((x - xmin) / (xmax - xmin)) * (width - pad.left - pad.right);
  const py = (y) => height - pad.bottom - ((y - ymin) / (ymax - ymin)) * (height - pad.top - pad.bottom);

  g.strokeStyle = "#e6e6e6"; g.fillStyle = "#444"; g.lineWidth = 1;
  g.textAlign = "right"; g.textBaseline = "middle";
  for (const v of yticks) {
    const y = py(v);
    g.beginPath(); g.moveTo(pad.left, y); g.lineTo(width - pad.right, y); g.stroke();
    g.fillText(options.format ? options.format(v) : fmtNumber(v), pad.left - 6, y);
  }
  g.textAlign = "center"; g.textBaseline = "top";
  for (const v of niceTicks(xmin, xmax, Math.max(2, Math.floor((width - pad.left) / 110)))) {
    const x = px(v), label = fmtClock(v), half = g.measureText(label).width / 2;
    g.beginPath(); g.moveTo(x, pad.top); g.lineTo(x, height - pad.bottom); g.stroke();
    if (x - half >= 0 && x + half <= width) g.fillText(label, x, height - pad.bottom + 4);
  }

  g.lineWidth = 1.8;
  for (const line of lines) {
    g.strokeStyle = line.color; g.fillStyle = line.color;
    let open = false, alone = [];
    g.beginPath();
    line.xs.forEach((x, i) => {
      const y = line.ys[i];
      if (!finite(x) || !finite(y)) { open = false; return; }
      const prevOk = i > 0 && finite(line.ys[i - 1]), nextOk = i + 1 < line.ys.length && finite(line.ys[i + 1]);
      if (!prevOk && !nextOk) alone.push([px(x), py(y)]);
      if (open) g.lineTo(px(x), py(y)); else g.moveTo(px(x), py(y));
      open = true;
    });
    g.stroke();
    for (const [x, y] of alone) { g.beginPath(); g.arc(x, y, 2.5, 0, 2 * Math.PI); g.fill(); }
  }

  g.textAlign = "left"; g.textBaseline = "middle";
  let lx = pad.left;
  for (const line of legend) {
    g.fillStyle = line.color; g.fillRect(lx, height - 10, 10, 4);
    g.fillStyle = "#444"; g.fillText(line.label, lx + 14, height - 8);
    lx += 24 + g.measureText(line.label).width;
  }
  return points;
}

function peerColors(state) {
  const ids = Object.keys(state.series.peers).sort();
  return Object.fromEntries(ids.map((id, k) => [id, PALETTE[k % PALETTE.length]]));
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function renderPeers(state, colors) {
  const body = $("peers").querySelector("tbody");
  body.replaceChildren();
  if (!state.peers.length) {
    const tr = document.createElement("tr");
    const td = cell("no live peers", "empty");
    td.colSpan = 11;
    tr.appendChild(td);
    body.appendChild(tr);
  }
  for (const p of state.peers) {
    const tr = document.createElement("tr");
    tr.dataset.peer = p.peer_id;
    const id = cell(short(p.peer_id), "peer");
    id.title = p.peer_id;
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = colors[p.peer_id] || "#999";
    id.prepend(swatch);
    tr.append(
      id, cell(p.label),
      cell(String(p.outer_step)),
      cell(p.inner_steps === null ? "—" : String(p.inner_steps)), cell(fmtNumber(p.loss, 4)),
      cell(fmtNumber(p.samples_per_second)), cell(p.exchanges_ok === null ? "—" : String(p.exchanges_ok)),
      cell(p.exchanges_failed === null ? "—" : String(p.exchanges_failed)), cell(fmtBytes(p.bytes_sent)),
      cell(fmtBytes(p.bytes_received)), cell(`${Math.round(p.last_seen)} s ago`),
    );
    body.appendChild(tr);
  }
}

function renderConfig(state) {
  const body = $("config").querySelector("tbody");
  body.replaceChildren();
  if (!state.config) {
    body.appendChild(document.createElement("tr")).appendChild(cell(state.missing, "empty"));
    return;
  }
  const rows = Object.entries(state.config).sort(([a], [b]) => a.localeCompare(b));
  if (state.created_by) rows.unshift(["created by", state.created_by]);
  for (const [key, value] of rows) {
    const tr = document.createElement("tr");
    tr.append(cell(key), cell(value === null ? "—" : String(value)));
    body.appendChild(tr);
  }
}

function renderCharts(state, colors) {
  const s = state.series;
  const perPeer = (field) => Object.entries(s.peers).sort(([a], [b]) => a.localeCompare(b))
    .map(([id, p]) => ({ label: short(id), color: colors[id], xs: p.t, ys: p[field] }));
  const swarm = (ys, color) => [{ color, xs: s.t, ys }];
  const drawn = window.murmur.points;
  drawn.loss = drawChart($("chart-loss"), perPeer("loss"));
  drawn.alive = drawChart($("chart-alive"), swarm(s.alive, PALETTE[0]), { zero: true });
  drawn.exchanges = drawChart($("chart-exchanges"), swarm(s.exchanges_per_minute, PALETTE[2]), { zero: true });
  drawn.bytes = drawChart($("chart-bytes"), perPeer("bytes"), { zero: true, format: fmtBytes });
  drawn.consensus = drawChart($("chart-consensus"), swarm(s.consensus, PALETTE[3]), {
    zero: true, empty: "needs sketches from two live peers",
  });
}

function renderHeader(state) {
  $("run").textContent = state.run;
  const c = state.config;
  $("summary").textContent = c ? `model ${c.model}, H=${c.inner_steps}, rank ${c.rank}` : state.missing;
  $("alive").textContent = String(state.peers.length);
  $("consensus-value").textContent = fmtNumber(state.consensus_estimate, 3);
  const age = state.read_at === null ? null : Math.max(0, state.now - state.read_at);
  if (state.error) {
    setFreshness(`stale: ${state.error}` + (age === null ? "" : ` (last reading ${Math.round(age)} s ago)`), true);
  } else if (age === null) {
    setFreshness("waiting for the first reading of the DHT", true);
  } else {
    setFreshness(`updated ${Math.round(age)} s ago`, age > 3 * state.period);
  }
}

function setFreshness(text, stale) {
  const el = $("freshness");
  el.textContent = text;
  el.className = stale ? "stale" : "fresh";
}

function render(state) {
  const colors = peerColors(state);
  renderHeader(state);
  renderPeers(state, colors);
  renderConfig(state);
  renderCharts(state, colors);
  window.murmur.renders += 1;
  window.murmur.state = state;
}

let period = 2;
async function refresh() {
  let state;
  try {
    const response = await fetch("api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    state = await response.json();
  } catch (e) {
    setFreshness(`the dashboard's server does not answer: ${e.message}`, true);
    return;
  } finally {
    setTimeout(refresh, period * 1000);
  }
  period = Math.max(1, Math.min(10, state.period || 2));
  render(state);
}
window.addEventListener("resize", () => window.murmur.state && renderCharts(window.murmur.state,
                                                                              peerColors(window.murmur.state)));
refresh();
