// swarm-node dashboard: reads /api/v1/ and redraws on every server-sent "update" event.
// Every text that comes from the swarm is put on screen with textContent, never as markup:
// peer IDs, reasons and names are data, not markup.
"use strict";

const API = "/api/v1";
const state = { sort: "balance", order: "desc", search: "", cursor: null, back: [], next: null };

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function row(cells, attrs) {
  const tr = el("tr", null, attrs);
  for (const cell of cells) {
    if (cell instanceof HTMLTableCellElement) tr.append(cell);
    else tr.append(cell instanceof Node ? wrap(cell) : el("td", cell));
  }
  return tr;
}

function wrap(node) {
  const td = el("td");
  td.append(node);
  return td;
}

function short(peer) {
  return peer && peer.length > 16 ? peer.slice(0, 6) + "…" + peer.slice(-8) : peer;
}

function peerCell(peer) {
  const td = el("td", short(peer), { title: peer, class: "peer" });
  return td;
}

function when(ms) {
  if (ms === null || ms === undefined) return "–";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 90) return s + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  return new Date(ms).toISOString().replace("T", " ").slice(0, 19) + " UTC";
}

async function get(path) {
  const res = await fetch(API + path, { headers: { Accept: "application/json" } });
  if (!res.ok) {
    let msg = res.status + "";
    try { msg = (await res.json()).error || msg; } catch (_) { /* not JSON */ }
    throw new Error(msg);
  }
  return res.json();
}

function fill(tbodySelector, rows) {
  document.querySelector(tbodySelector).replaceChildren(...rows);
}

async function loadStatus() {
  const s = await get("/status");
  document.getElementById("run-name").textContent = s.run.name;
  document.getElementById("run-id").textContent = s.run.run_id;
  document.getElementById("policy-version").textContent =
    s.policy_version === null ? "none yet" : "v" + s.policy_version;
  const n = s.node || {};
  const rs = n.role_status || {};
  const facts = [
    ["peer ID", n.peer_id],
    ["role", n.role],
    ["connected peers", n.connected_peers],
    ["reachability", n.reachability],
    ["uptime", n.uptime_s === undefined ? null : Math.round(n.uptime_s) + " s"],
    ["listening on", (n.listen_addrs || []).join(" ")],
    ["ledger events", s.ledger ? s.ledger.events : "no ledger kept here"],
    ["verdicts seen", s.ledger ? s.ledger.verdicts : null],
    ["own balance", rs.ledger ? rs.ledger.balance : null],
  ];
  for (const section of ["worker", "validator", "trainer"]) {
    for (const [k, v] of Object.entries(rs[section] || {})) {
      if (v === null || typeof v === "object") continue;
      facts.push([section + " " + k, v]);
    }
  }
  const dl = document.getElementById("node-status");
  const items = [];
  for (const [k, v] of facts) {
    if (v === null || v === undefined || v === "") continue;
    items.push(el("dt", k), el("dd", v));
  }
  dl.replaceChildren(...items);
}

async function loadVersions() {
  const page = await get("/versions?limit=20");
  fill("#versions-table tbody", page.items.map((v) => row([
    "v" + v.version, when(v.announced_at_ms), when(v.seen_at_ms), peerCell(v.trainer),
    el("code", v.manifest.slice(0, 16)),
    v.holders === null || v.holders === undefined ? "not looked up" : String(v.holders.length),
  ], { "data-version": String(v.version) })));
}

const SVGNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function drawChart(items, evals) {
  const box = document.getElementById("reward-chart");
  const pts = items.filter((r) => r.mean_reward !== null).sort((a, b) => a.version - b.version);
  const evs = (evals || []).slice().sort((a, b) => a.version - b.version);
  if (!pts.length && !evs.length) {
    box.replaceChildren(el("p", "no accepted samples yet", { class: "note" }));
    return;
  }
  const W = 600, H = 220, L = 40, R = 10, T = 10, B = 28;
  const vs = [...pts, ...evs].map((p) => p.version);
  const v0 = Math.min(...vs), v1 = Math.max(...vs, v0 + 1);
  const x = (v) => L + ((v - v0) / (v1 - v0)) * (W - L - R);
  const y = (r) => T + (1 - Math.max(0, Math.min(1, r))) * (H - T - B);
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  chart.append(svg("line", { x1: L, y1: y(0), x2: W - R, y2: y(0), class: "axis" }));
  chart.append(svg("line", { x1: L, y1: T, x2: L, y2: y(0), class: "axis" }));
  for (const r of [0, 0.5, 1]) {
    const t = svg("text", { x: 4, y: y(r) + 4 });
    t.textContent = r.toFixed(1);
    chart.append(t);
  }
  for (const v of [v0, v1]) {
    const t = svg("text", { x: x(v) - 8, y: H - 8 });
    t.textContent = "v" + v;
    chart.append(t);
  }
  const line = (key, cls) => svg("polyline", {
    class: cls,
    points: pts.filter((p) => p[key] !== null).map((p) => `${x(p.version)},${y(p[key])}`).join(" "),
  });
  chart.append(line("mean_reward", "raw"), line("smoothed", "smooth"));
  for (const p of pts) {
    const dot = svg("circle", { cx: x(p.version), cy: y(p.mean_reward), r: 3, class: "dot" });
    const tip = svg("title");
    tip.textContent = `v${p.version}: ${p.mean_reward.toFixed(3)} (${p.samples} samples)`;
    dot.append(tip);
    chart.append(dot);
  }
  // The held-out evaluation: one signed point per evaluated version, drawn over the rewards.
  const evalLine = svg("polyline", {
    class: "eval", points: evs.map((e) => `${x(e.version)},${y(e.mean)}`).join(" "),
  });
  chart.append(evalLine);
  for (const e of evs) {
    const mark = svg("rect", {
      x: x(e.version) - 3.5, y: y(e.mean) - 3.5, width: 7, height: 7, class: "eval-dot",
      "data-version": e.version,
    });
    const tip = svg("title");
    tip.textContent = `evaluation v${e.version}: ${e.mean.toFixed(3)} (${e.items} held-out items)`;
    mark.append(tip);
    chart.append(mark);
  }
  box.replaceChildren(chart);
}

async function loadRewards() {
  const page = await get("/rewards?limit=200");
  const last = page.items[0];
  document.getElementById("rewards-note").textContent =
    "blue: mean reward of accepted samples per version; orange: " + page.smoothing +
    (last && last.mean_reward !== null ? ` · latest v${last.version}: ${last.mean_reward.toFixed(3)}` : "");
  const evs = page.eval.items;
  const lastEval = evs.length ? evs[evs.length - 1] : null;
  document.getElementById("eval-note").textContent = page.eval.available
    ? `green squares: held-out evaluation (${lastEval.items} items, every ${page.eval.eval_every}` +
      ` versions) · latest v${lastEval.version}: ${lastEval.mean.toFixed(3)}` +
      (evs.length > 1 ? ` · gain ${(lastEval.mean - evs[0].mean).toFixed(3)} since v${evs[0].version}` : "")
    : "evaluation curve: absent (" + page.eval.reason + ")";
  drawChart(page.items, evs);
}

async function loadContributors() {
  const q = new URLSearchParams({ limit: "50", sort: state.sort, order: state.order });
  if (state.search) q.set("search", state.search);
  if (state.cursor) q.set("cursor", state.cursor);
  const page = await get("/contributors?" + q.toString());
  state.next = page.next_cursor;
  document.getElementById("contributors-count").textContent = page.total + " peers";
  document.getElementById("contributors-next").disabled = !page.next_cursor;
  document.getElementById("contributors-prev").disabled = state.back.length === 0;
  for (const th of document.querySelectorAll("#contributors-table th[data-sort]")) {
    th.classList.remove("sorted-asc", "sorted-desc");
    if (th.dataset.sort === state.sort) th.classList.add("sorted-" + state.order);
  }
  fill("#contributors-table tbody", page.items.map((c) => {
    const ban = el("span", c.banned ? "banned" : "no", c.banned ? { class: "badge-banned" } : {});
    const tr = row([
      peerCell(c.peer), c.role, c.accepted, c.rejected, c.balance, ban, when(c.last_seen_ms),
      c.requests ? c.requests.text : "–",
    ], { "data-peer": c.peer });
    if (c.banned) tr.classList.add("banned");
    return tr;
  }));
}

async function loadSlashes() {
  const page = await get("/slashes?limit=50");
  fill("#slashes-table tbody", page.items.map((s) => {
    const link = el("a", "audit bundle", { href: s.bundle_url, download: "bundle-" + s.evidence.slice(0, 16) + ".msgpack", class: "bundle" });
    return row([
      when(s.created_at_ms), peerCell(s.peer), s.amount,
      s.policy_version === null ? "–" : "v" + s.policy_version,
      el("span", (s.reasons || []).join("; ") || "(verdict not seen here)", { class: "reason" }), link,
    ], { "data-peer": s.peer });
  }));
  const disputes = await get("/disputes?limit=50");
  document.getElementById("disputes-note").textContent = disputes.supported
    ? disputes.items.length + " disputes" : "this ledger records no disputes (not supported by its version)";
  fill("#disputes-table tbody", disputes.items.map((d) => row([
    when(d.created_at_ms), peerCell(d.peer || ""), d.reason || "", d.status || "",
  ])));
  const training = await get("/training-disputes");
  document.getElementById("training-disputes-note").textContent = training.items.length
    ? training.items.length + " training disputes: check with swarm-node audit --training"
    : "no training disputes: every audited step replayed";
  fill("#training-disputes-table tbody", training.items.map((d) => row([
    "v" + d.version, d.reason, peerCell(d.trainer), short(d.by), el("span", d.detail, { class: "reason" }),
  ])));
}

async function loadShardcast() {
  const s = await get("/shardcast");
  fill("#holders-table tbody", s.holders.map((h) => row([
    "v" + h.version, h.peers.map(short).join(", ") || "none found",
  ])));
  fill("#downloads-table tbody", s.downloads.map((d) => row([
    "v" + d.version, d.shards, d.rate_mib_s + " MiB/s",
    (d.peers || []).map((p) => short(String(p.peer || "")) + " (" + (p.rate_mib_s ?? "?") + ")").join(", "),
  ])));
  const t = s.transfers || { versions: {}, bytes: 0, saved_bytes: 0 };
  const kib = (n) => (n / 1024).toFixed(1) + " KiB";
  document.getElementById("transfers-note").textContent = "moved " + kib(t.bytes)
    + ", saved " + kib(t.saved_bytes) + " against whole versions";
  fill("#transfers-table tbody", Object.entries(t.versions).reverse().map(([v, x]) => row([
    "v" + v, x.patch ? "patch" : "whole", kib(x.bytes), kib(x.full),
  ])));
}

const ledgerState = { cursor: null, next: null };

async function loadLedger() {
  const q = new URLSearchParams({ limit: "20" });
  if (ledgerState.cursor) q.set("cursor", ledgerState.cursor);
  const page = await get("/ledger?" + q.toString());
  ledgerState.next = page.next_cursor;
  document.getElementById("ledger-older").disabled = !page.next_cursor;
  fill("#ledger-table tbody", page.items.map((e) => row([
    when(e.created_at_ms), e.event, peerCell(e.peer), e.amount, peerCell(e.signer),
    el("code", e.evidence.slice(0, 16)),
  ], { "data-peer": e.peer })));
}

const loaders = [
  loadStatus, loadVersions, loadRewards, loadContributors, loadSlashes, loadLedger, loadShardcast,
];
let busy = false, again = false;

async function refresh() {
  if (busy) { again = true; return; }
  busy = true;
  try {
    await Promise.all(loaders.map((f) => f().catch((e) => console.warn(f.name, e.message))));
  } finally {
    busy = false;
    if (again) { again = false; refresh(); }
  }
}

function live() {
  const badge = document.getElementById("live");
  const source = new EventSource(API + "/stream");
  source.addEventListener("update", (e) => {
    badge.textContent = "live";
    badge.className = "live on";
    const d = JSON.parse(e.data);
    if (d.policy_version !== null) {
      document.getElementById("policy-version").textContent = "v" + d.policy_version;
    }
    refresh();
  });
  source.onerror = () => { badge.textContent = "reconnecting…"; badge.className = "live off"; };
}

function controls() {
  let timer = null;
  document.getElementById("contributor-search").addEventListener("input", (e) => {
    clearTimeout(timer);
    timer = setTimeout(() => {
      state.search = e.target.value.trim();
      state.cursor = null; state.back = [];
      loadContributors().catch((err) => console.warn(err.message));
    }, 200);
  });
  for (const th of document.querySelectorAll("#contributors-table th[data-sort]")) {
    th.addEventListener("click", () => {
      const key = th.dataset.sort;
      state.order = state.sort === key && state.order === "desc" ? "asc" : "desc";
      state.sort = key; state.cursor = null; state.back = [];
      loadContributors();
    });
  }
  document.getElementById("contributors-next").addEventListener("click", () => {
    if (!state.next) return;
    state.back.push(state.cursor); state.cursor = state.next; loadContributors();
  });
  document.getElementById("ledger-older").addEventListener("click", () => {
    if (!ledgerState.next) return;
    ledgerState.cursor = ledgerState.next; loadLedger();
  });
  document.getElementById("ledger-newest").addEventListener("click", () => {
    ledgerState.cursor = null; loadLedger();
  });
  document.getElementById("contributors-prev").addEventListener("click", () => {
    if (!state.back.length) return;
    state.cursor = state.back.pop(); loadContributors();
  });
}

controls();
refresh();
live();
// The node's own figures (uptime, peers) change without a ledger change: re-read them slowly.
setInterval(() => { loadStatus().catch(() => {}); loadShardcast().catch(() => {}); }, 5000);
