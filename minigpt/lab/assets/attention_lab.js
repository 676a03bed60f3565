/* Attention lab page script.  Reads the JSON in #lab-data, inflates the weights and builds three views:
   head view (canvas lines between two token columns), model view (a grid of heatmaps), heads table.
   No network: everything it needs is in this file.  When the views are built, body[data-ready] = "1";
   errors are collected into body[data-errors] (JSON) so a headless browser can check them. */
"use strict";

const errors = [];
function recordError(message) {
  errors.push(String(message));
  document.body.dataset.errors = JSON.stringify(errors);
}
window.addEventListener("error", (e) => recordError(e.message || e.type));
window.addEventListener("unhandledrejection", (e) => recordError(e.reason && e.reason.message || e.reason));
const consoleError = console.error.bind(console);
console.error = (...args) => { recordError(args.join(" ")); consoleError(...args); };

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
};

/* ---------------------------------------------------------------- data */

const data = JSON.parse($("lab-data").textContent);
for (const m of data.metric_names) data.metrics[m] = data.metrics[m].map((row) => row.map((v) => (v === null ? NaN : v)));
const L = data.n_layer, H = data.n_head, T = data.tokens.length, G = data.kv_group;
const TRI = T * (T + 1) / 2;
let W = null; /* Uint8Array: per (layer, head) the lower triangle, row by row; weight = byte / 255 */

function b64bytes(text) {
  const bin = atob(text.replace(/-/g, "+").replace(/_/g, "/"));
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
async function inflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}
const base = (l, h) => (l * H + h) * TRI;
const weight = (l, h, t, s) => (s > t ? 0 : W[base(l, h) + t * (t + 1) / 2 + s] / 255);

/* magma, as in the PNG figures; colour = sqrt(weight) */
const MAGMA = [[0, 0, 4], [28, 16, 68], [79, 18, 123], [129, 37, 129], [181, 54, 122], [229, 80, 100],
  [251, 135, 97], [254, 194, 135], [252, 253, 191]];
const LUT = new Uint8Array(256 * 3);
for (let i = 0; i < 256; i++) {
  const x = i / 255 * (MAGMA.length - 1), k = Math.min(Math.floor(x), MAGMA.length - 2), f = x - k;
  for (let c = 0; c < 3; c++) LUT[i * 3 + c] = Math.round(MAGMA[k][c] * (1 - f) + MAGMA[k + 1][c] * f);
}
const sqrtByte = new Uint8Array(256);
for (let i = 0; i < 256; i++) sqrtByte[i] = Math.round(Math.sqrt(i / 255) * 255);

const headColour = (h) => `hsl(${Math.round(h * 360 / H + 210) % 360}, 72%, 52%)`;
const kvColour = (k) => `hsl(${Math.round(k * 360 / Math.max(1, H / G) + 30) % 360}, 60%, 55%)`;
function shown(token) {
  if (token === "") return "\u2205";
  return token.replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5").replace(/ /g, "\u00b7");
}
const fmt = (v, d = 3) => (v === null || Number.isNaN(v) ? "\u2013" : v.toFixed(d));

/* ---------------------------------------------------------------- theme */

function setTheme(theme) {
  document.documentElement.dataset.theme = theme;
  $("theme").textContent = theme === "dark" ? "Light theme" : "Dark theme";
  try { localStorage.setItem("attention-lab-theme", theme); } catch (e) { /* file pages may refuse storage */ }
  if (W) drawHeadView();
}
function initTheme() {
  let theme = null;
  try { theme = localStorage.getItem("attention-lab-theme"); } catch (e) { theme = null; }
  if (!theme) theme = window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
  setTheme(theme);
  $("theme").addEventListener("click", () =>
    setTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark"));
}

/* ---------------------------------------------------------------- head view */

const ROW = 22;
const state = { layer: 0, heads: new Set(Array.from({ length: H }, (_, h) => h)), hover: null };

function buildHeadView() {
  const layer = $("layer");
  for (let l = 0; l < L; l++) layer.append(new Option(`${l}`, `${l}`));
  layer.addEventListener("change", () => { state.layer = +layer.value; drawHeadView(); });

  const chips = $("heads");
  for (let k = 0; k < H / G; k++) {
    const box = G > 1 ? el("div", "group") : chips;
    if (G > 1) {
      box.title = `query heads ${k * G}\u2013${(k + 1) * G - 1} share key/value head ${k}`;
      box.append(el("span", "kv", `kv ${k}`));
      chips.append(box);
    }
    for (let h = k * G; h < (k + 1) * G; h++) {
      const chip = el("span", "chip", `${h}`);
      chip.style.setProperty("--c", headColour(h));
      chip.dataset.head = h;
      chip.title = "click: show or hide this head; double-click: only this head";
      chip.addEventListener("click", () => { toggleHead(h); });
      chip.addEventListener("dblclick", () => { soloHead(h); });
      box.append(chip);
    }
  }
  $("all-heads").addEventListener("click", () => { for (let h = 0; h < H; h++) state.heads.add(h); drawHeadView(); });
  $("no-heads").addEventListener("click", () => { state.heads.clear(); drawHeadView(); });

  for (const side of ["left", "right"]) {
    const column = $(`hv-${side}`);
    data.tokens.forEach((token, t) => {
      const node = el("div", "tok", shown(token));
      node.title = `${side === "left" ? "query" : "key"} ${t}: ${JSON.stringify(token)}`;
      node.addEventListener("mouseenter", () => { state.hover = { side, t }; drawHeadView(); });
      node.addEventListener("mouseleave", () => { state.hover = null; drawHeadView(); });
      column.append(node);
    });
  }
  const canvas = $("hv-canvas");
  const ratio = window.devicePixelRatio || 1;
  canvas.width = 170 * ratio;
  canvas.height = T * ROW * ratio;
  canvas.style.height = `${T * ROW}px`;
}
function toggleHead(h) {
  if (state.heads.has(h)) state.heads.delete(h); else state.heads.add(h);
  drawHeadView();
}
function soloHead(h) {
  state.heads = new Set([h]);
  drawHeadView();
}

function drawHeadView() {
  const canvas = $("hv-canvas");
  const ctx = canvas.getContext("2d");
  const ratio = canvas.width / 170;
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, 170, T * ROW);
  ctx.globalCompositeOperation = document.documentElement.dataset.theme === "dark" ? "lighter" : "source-over";
  document.querySelectorAll(".chip").forEach((c) => c.classList.toggle("off", !state.heads.has(+c.dataset.head)));
  const heads = [...state.heads].sort((a, b) => a - b);
  const hover = state.hover;
  const l = state.layer;
  let lines = 0;
  const y = (t) => t * ROW + ROW / 2;
  const minWeight = hover ? 0.005 : 0.02;
  for (const h of heads) {
    ctx.strokeStyle = headColour(h);
    for (let t = 0; t < T; t++) {
      if (hover && hover.side === "left" && hover.t !== t) continue;
      for (let s = 0; s <= t; s++) {
        if (hover && hover.side === "right" && hover.t !== s) continue;
        const w = weight(l, h, t, s);
        if (w < minWeight) continue;
        ctx.globalAlpha = Math.min(1, 0.15 + 0.85 * w);
        ctx.lineWidth = 0.6 + 3 * w;
        ctx.beginPath();
        ctx.moveTo(2, y(t));
        ctx.lineTo(168, y(s));
        ctx.stroke();
        lines++;
      }
    }
  }
  ctx.globalAlpha = 1;
  $("hv-body").dataset.lines = lines;
  shadeTokens(heads, hover);
}

/* hovering a query shades the keys by the weight it gives them (mean over the shown heads), and the reverse */
function shadeTokens(heads, hover) {
  const left = $("hv-left").children, right = $("hv-right").children;
  for (let t = 0; t < T; t++) {
    left[t].style.background = "var(--token)";
    right[t].style.background = "var(--token)";
    left[t].classList.remove("active");
    right[t].classList.remove("active");
  }
  if (!hover || heads.length === 0) return;
  const mine = hover.side === "left" ? left : right, other = hover.side === "left" ? right : left;
  mine[hover.t].classList.add("active");
  for (let u = 0; u < T; u++) {
    let sum = 0;
    for (const h of heads) {
      sum += hover.side === "left" ? weight(state.layer, h, hover.t, u) : weight(state.layer, h, u, hover.t);
    }
    const w = sum / heads.length;
    if (w > 0) other[u].style.background = `rgba(var(--hl), ${Math.min(0.85, 0.08 + Math.sqrt(w) * 0.8)})`;
  }
}

function showHead(l, h) {
  state.layer = l;
  $("layer").value = `${l}`;
  soloHead(h);
  $("head-view").scrollIntoView({ behavior: "smooth", block: "start" });
}

/* ---------------------------------------------------------------- model view */

function heatmap(canvas, l, h) {
  canvas.width = T;
  canvas.height = T;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(T, T);
  const px = image.data;
  for (let t = 0; t < T; t++) {
    const row = base(l, h) + t * (t + 1) / 2;
    for (let s = 0; s <= t; s++) {
      const v = sqrtByte[W[row + s]], i = (t * T + s) * 4;
      px[i] = LUT[v * 3];
      px[i + 1] = LUT[v * 3 + 1];
      px[i + 2] = LUT[v * 3 + 2];
      px[i + 3] = 255;
    }
  }
  ctx.putImageData(image, 0, 0);
}

function buildModelView() {
  const grid = $("mv-grid");
  const room = ($("model-view").clientWidth || 600) - 110;
  const cell = Math.max(36, Math.min(150, Math.floor(room / H) - 4));
  grid.style.gridTemplateColumns = `auto repeat(${H}, ${cell}px)`;
  grid.append(el("span", "lab"));
  for (let h = 0; h < H; h++) {
    const label = el("span", "lab col", G > 1 ? `h${h}\u00b7kv${Math.floor(h / G)}` : `head ${h}`);
    if (G > 1) label.style.setProperty("--kvc", kvColour(Math.floor(h / G)));
    grid.append(label);
  }
  for (let l = 0; l < L; l++) {
    grid.append(el("span", "lab row", `layer ${l}`));
    for (let h = 0; h < H; h++) {
      const canvas = el("canvas", "mv-cell");
      canvas.style.width = canvas.style.height = `${cell}px`;
      canvas.title = `layer ${l}, head ${h}${G > 1 ? `, kv head ${Math.floor(h / G)}` : ""}: click to enlarge`;
      heatmap(canvas, l, h);
      canvas.addEventListener("click", () => openModal(l, h));
      grid.append(canvas);
    }
  }
  const legend = $("legend").getContext("2d");
  const strip = legend.createImageData(256, 1);
  for (let i = 0; i < 256; i++) {
    strip.data.set([LUT[i * 3], LUT[i * 3 + 1], LUT[i * 3 + 2], 255], i * 4);
  }
  legend.putImageData(strip, 0, 0);
  if (G > 1) {
    $("gqa").textContent = `Grouped-query attention: ${H} query heads share ${H / G} key/value heads, ${G} each ` +
      "(the coloured bars under the head labels, the dashed boxes in the head view). Heads of a group read the " +
      "same keys, so their maps differ only through their queries.";
  }
}

function openModal(l, h) {
  const modal = $("modal"), canvas = $("modal-canvas");
  const size = Math.max(T, Math.floor(Math.min(window.innerWidth * 0.8, window.innerHeight * 0.7, 640) / T) * T);
  heatmap(canvas, l, h);
  canvas.style.width = canvas.style.height = `${size}px`;
  $("modal-title").textContent = `Layer ${l}, head ${h}${G > 1 ? ` (key/value head ${Math.floor(h / G)})` : ""}`;
  $("modal-metrics").textContent = data.metric_names.map((m, i) =>
    `${data.metric_titles[i]}: ${fmt(data.metrics[m][l][h])}`).join("   ");
  canvas.onmousemove = (e) => {
    const r = canvas.getBoundingClientRect();
    const t = Math.floor((e.clientY - r.top) / r.height * T), s = Math.floor((e.clientX - r.left) / r.width * T);
    if (t < 0 || s < 0 || t >= T || s >= T) return;
    $("modal-tip").textContent = s > t
      ? `query ${t} cannot see key ${s} (causal mask)`
      : `query ${t} ${JSON.stringify(data.tokens[t])} \u2192 key ${s} ${JSON.stringify(data.tokens[s])}: ` +
        `${weight(l, h, t, s).toFixed(3)}`;
  };
  modal.hidden = false;
}
function initModal() {
  const modal = $("modal");
  $("modal-close").addEventListener("click", () => { modal.hidden = true; });
  modal.addEventListener("click", (e) => { if (e.target === modal) modal.hidden = true; });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") modal.hidden = true; });
}

/* ---------------------------------------------------------------- heads table */

function tags(l, h) {
  const m = (name) => data.metrics[name][l][h];
  const out = [];
  if (m("previous") > 0.5) out.push("previous token");
  if (m("induction") > 0.3) out.push("induction");
  if (m("first") > 0.5) out.push("sink");
  return out;
}

function buildTable() {
  const columns = [["layer", "layer"], ["head", "head"]];
  if (G > 1) columns.push(["kv", "kv head"]);
  data.metric_names.forEach((m, i) => columns.push([m, data.metric_titles[i]]));
  columns.push(["tags", "looks like"]);
  const rows = [];
  for (let l = 0; l < L; l++) {
    for (let h = 0; h < H; h++) {
      const row = { layer: l, head: h, kv: Math.floor(h / G), tags: tags(l, h) };
      for (const m of data.metric_names) row[m] = data.metrics[m][l][h];
      rows.push(row);
    }
  }
  /* bar lengths: the weights (first, previous, induction) on their own 0..1 scale, so a small score looks
     small; entropy and distance against the column's largest value */
  const max = {};
  for (const m of data.metric_names) {
    max[m] = ["first", "previous", "induction"].includes(m) ? 1
      : Math.max(1e-9, ...rows.map((r) => (Number.isNaN(r[m]) ? 0 : r[m])));
  }
  const head = $("heads-table").tHead, body = $("heads-table").tBodies[0];
  const tr = head.insertRow();
  columns.forEach(([key, title], i) => {
    const th = el("th", key === "tags" ? "text" : "", title);
    const info = data.metric_info[data.metric_names.indexOf(key)];
    if (info) th.title = info;
    th.addEventListener("click", () => sortBy(key, th));
    tr.append(th);
  });
  function render() {
    body.textContent = "";
    for (const r of rows) {
      const row = body.insertRow();
      for (const [key] of columns) {
        const td = row.insertCell();
        if (key === "tags") {
          td.className = "text";
          for (const tag of r.tags) td.append(el("span", "tag", tag));
        } else if (data.metric_names.includes(key)) {
          td.className = "bar";
          td.style.setProperty("--v", `${Number.isNaN(r[key]) ? 0 : (100 * r[key] / max[key]).toFixed(1)}%`);
          td.textContent = fmt(r[key], key === "distance" ? 2 : 3);
        } else {
          td.textContent = r[key];
        }
      }
      row.addEventListener("click", () => showHead(r.layer, r.head));
    }
  }
  let sorted = { key: null, dir: 1 };
  function sortBy(key, th) {
    sorted = { key, dir: sorted.key === key ? -sorted.dir : (key === "layer" || key === "head" ? 1 : -1) };
    const value = (r) => (key === "tags" ? r.tags.join(" ") : Number.isNaN(r[key]) ? -Infinity : r[key]);
    rows.sort((a, b) => (value(a) < value(b) ? -1 : value(a) > value(b) ? 1 : 0) * sorted.dir ||
      a.layer - b.layer || a.head - b.head);
    head.querySelectorAll("th").forEach((x) => x.removeAttribute("aria-sort"));
    th.setAttribute("aria-sort", sorted.dir > 0 ? "ascending" : "descending");
    render();
  }
  render();
  $("table-hint").textContent = "Click a column to sort, a row to show that head in the head view. Induction: " +
    (data.induction_tokens ? `measured on ${data.induction_tokens} random tokens repeated twice.` :
      "not measured (block_size below 4).");
}

/* ---------------------------------------------------------------- start */

async function main() {
  initTheme();
  $("summary").textContent = data.summary;
  W = await inflate(b64bytes(data.weights));
  if (W.length !== L * H * TRI) throw new Error(`weights hold ${W.length} bytes, expected ${L * H * TRI}`);
  buildHeadView();
  buildModelView();
  buildTable();
  initModal();
  drawHeadView();
  document.body.dataset.renderMs = Math.round(performance.now());
  document.body.dataset.ready = "1";
}
main().catch((e) => recordError(e && e.stack || e));
