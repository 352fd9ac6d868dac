// The shardplane web view: polls /ui/api/state and draws it. Read-only.
// Every text from the cluster goes into the page as text (textContent),
// never as markup.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const POLL_MS = 2000;
const COLOURS = ["#58a6ff", "#f0883e", "#a371f7", "#3fb950", "#db61a2", "#e3b341", "#39c5cf", "#ff7b72"];

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
}

function latency(micros) {
  return micros < 1000 ? micros + " µs" : (micros / 1000).toFixed(1) + " ms";
}

function bandwidth(mbps) {
  if (!mbps) return "";
  return mbps >= 1000 ? (mbps / 1000).toFixed(1) + " Gb/s" : mbps + " Mb/s";
}

function readyWord(ready) {
  return ready.split(" ")[0];
}

// ---- topology -------------------------------------------------------------

function layout(nodes) {
  const maxMem = Math.max(1, ...nodes.map(n => n.allocatableBytes || n.totalBytes || 0));
  const boxes = nodes.map(n => {
    const share = Math.sqrt((n.allocatableBytes || n.totalBytes || 0) / maxMem);
    const w = Math.round(120 + 80 * share);
    return { node: n, w, h: Math.round(w * 0.55) };
  });
  const count = boxes.length;
  const widest = Math.max(140, ...boxes.map(b => b.w));
  const radius = count <= 1 ? 0 : Math.max(230, (count * (widest + 70)) / (2 * Math.PI));
  const squash = 0.85;
  const cx = radius + widest / 2 + 30;
  const cy = radius * squash + widest * 0.55 / 2 + 30;
  boxes.forEach((b, i) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, count);
    b.x = cx + radius * Math.cos(angle);
    b.y = cy + radius * squash * Math.sin(angle);
  });
  return { boxes, width: 2 * cx, height: 2 * cy };
}

function drawTopology(state) {
  const root = document.getElementById("topology");
  root.replaceChildren();
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  const { boxes, width, height } = layout(state.nodes);
  root.setAttribute("width", width);
  root.setAttribute("height", height);
  root.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const at = new Map(boxes.map(b => [b.node.name, b]));

  // Links: each pair once, labelled with what one side measured.
  const seen = new Set();
  const links = svg("g", { class: "links" });
  const labels = [];
  for (const n of state.nodes) {
    for (const l of n.links) {
      const a = at.get(n.name), b = at.get(l.to);
      const key = [n.name, l.to].sort().join("\u0000");
      if (!a || !b || seen.has(key)) continue;
      seen.add(key);
      links.append(svg("line", { class: "link", x1: a.x, y1: a.y, x2: b.x, y2: b.y }));
      const label = [latency(l.latencyMicros), bandwidth(l.bandwidthMbps)].filter(Boolean).join(" · ");
      // On the part of the line between the boxes, a little nearer the
      // first-named node, so that labels of lines crossing in the middle
      // do not land on each other.
      const [p, q] = n.name < l.to ? [a, b] : [b, a];
      const dx = q.x - p.x, dy = q.y - p.y;
      const out = box => Math.min(box.w / 2 / Math.abs(dx || 1e-9), box.h / 2 / Math.abs(dy || 1e-9));
      const from = out(p), to = 1 - out(q);
      const t = from + (to - from) * 0.42;
      labels.push(svg("text", {
        class: "linklabel", x: p.x + dx * t, y: p.y + dy * t + 4, "text-anchor": "middle",
        "data-link": key.replace("\u0000", "--"),
      }, label));
    }
  }
  if (seen.size === 0 && state.nodes.length > 1) {
    links.append(svg("text", { class: "linklabel", x: 12, y: height - 12 }, "no links measured yet"));
  }
  root.append(links);
  // Labels above the boxes, each on a backing of the panel's colour (once
  // it can be measured).
  const tags = svg("g", { class: "linklabels" });
  root.append(tags);
  for (const t of labels) {
    tags.append(t);
    const box = t.getBBox();
    tags.insertBefore(svg("rect", {
      class: "labelback", x: box.x - 3, y: box.y - 1, width: box.width + 6, height: box.height + 2, rx: 3,
    }), t);
  }

  // Nodes.
  const nodes = svg("g", { class: "nodes" });
  for (const b of boxes) {
    const n = b.node;
    const word = readyWord(n.ready);
    const g = svg("g", {
      class: "node" + (word === "Ready" ? "" : " notready") + (n.unschedulable ? " cordoned" : ""),
      "data-node": n.name, "data-ready": n.ready,
      transform: `translate(${b.x - b.w / 2},${b.y - b.h / 2})`,
    });
    g.append(svg("title", {}, `${n.name}: ${n.ready}`));
    g.append(svg("rect", { class: "box", width: b.w, height: b.h, rx: 6 }));
    g.append(svg("text", { x: 8, y: 17, "font-weight": 600 }, n.name));
    g.append(svg("text", { x: 8, y: 32, class: "dim" },
      word === "Ready" ? (n.unschedulable ? "Ready, cordoned" : "Ready") : n.ready));
    const total = n.allocatableBytes || 0;
    const used = Math.min(n.usedBytes, total || n.usedBytes);
    g.append(svg("rect", { class: "membar", x: 8, y: b.h - 18, width: b.w - 16, height: 6, rx: 3 }));
    if (total > 0) {
      g.append(svg("rect", { class: "memused", x: 8, y: b.h - 18, width: ((b.w - 16) * used) / total, height: 6, rx: 3 }));
    }
    g.append(svg("text", { x: 8, y: b.h - 24, class: "dim" }, `${bytes(n.usedBytes)} / ${bytes(total || null)}`));
    nodes.append(g);
  }

  // Instances: a path through each instance's stages, offset so that
  // instances sharing nodes stay apart, and a numbered dot per stage.
  const paths = svg("g", { class: "instances" });
  let k = 0;
  for (const d of state.deployments) {
    for (const inst of d.instances) {
      const colour = COLOURS[k % COLOURS.length];
      const dx = ((k % 5) - 2) * 9, dy = 8 + (Math.floor(k / 5) % 3) * 9;
      k++;
      const points = inst.stages.map(s => at.get(s.node)).filter(Boolean).map(b => [b.x + dx, b.y + dy]);
      const id = `${d.namespace}/${d.name}#${inst.index}`;
      if (points.length > 1) {
        paths.append(svg("polyline", {
          class: "path", stroke: colour, points: points.map(p => p.join(",")).join(" "), "data-instance": id,
        }));
      }
      inst.stages.forEach((s, i) => {
        const b = at.get(s.node);
        if (!b) return;
        const g = svg("g", { class: "stage", "data-instance": id, "data-stage-node": s.node });
        g.append(svg("title", {}, `${id} stage ${i}: layers ${s.layers}, ${s.phase}`));
        g.append(svg("circle", { cx: b.x + dx, cy: b.y + dy, r: 8, fill: colour,
          opacity: s.phase === "Ready" ? 1 : 0.45 }));
        g.append(svg("text", { x: b.x + dx, y: b.y + dy + 3.5, "text-anchor": "middle" }, String(i)));
        paths.append(g);
      });
      const stages = inst.stages.map(s => `${s.node} [${s.layers}]`).join(" → ");
      legend.append(el("li", {}, el("span", { class: "swatch", style: null, "data-colour": colour }), `${id}: ${stages}`));
    }
  }
  root.insertBefore(nodes, tags);
  root.append(paths);
  // Inline styles are refused by the page's policy: colour swatches by attribute.
  for (const s of legend.querySelectorAll(".swatch")) {
    s.style.background = s.getAttribute("data-colour");
  }
}

// ---- deployments ----------------------------------------------------------

function trafficLine(d, state) {
  if (!state.trafficConfigured) return el("div", { class: "traffic dim" }, "traffic: no gateway metrics configured (--gateway-metrics)");
  const t = d.traffic;
  if (!t) return el("div", { class: "traffic dim", "data-traffic": d.name }, "no requests yet");
  const rate = (v, digits) => (v === null || v === undefined ? "–" : v.toFixed(digits));
  return el("div", {
    class: "traffic", "data-traffic": d.name,
    "data-tokens-per-second": t.tokensPerSecond === null ? "" : t.tokensPerSecond,
  },
    el("span", {}, el("b", {}, rate(t.tokensPerSecond, 1)), " tokens/s"),
    el("span", {}, el("b", {}, rate(t.requestsPerSecond, 2)), " requests/s"),
    el("span", {}, "TTFT p50 ", el("b", {}, seconds(t.ttftP50Seconds))),
    el("span", {}, el("b", {}, t.inFlight), " in flight"),
    el("span", { class: "dim" }, `${t.requests} requests, ${t.tokensOut} tokens since start`),
    t.errorsPerSecond ? el("span", { class: "ready-none" }, `${rate(t.errorsPerSecond, 2)} errors/s`) : null,
  );
}

function stageBox(s, i) {
  const box = el("div", { class: "stagebox " + s.phase, "data-shard": s.shard, "data-phase": s.phase },
    el("div", {}, el("b", {}, `${i}: ${s.node}`), ` layers ${s.layers}`),
    el("div", { class: "dim" }, s.phase + (s.restarts ? ` · ${s.restarts} restarts` : "") + (s.reason ? ` · ${s.reason}` : "")));
  if (s.phase === "Failed" && s.message) box.append(el("div", { class: "ready-none" }, s.message));
  if (s.totalBytes && s.downloadedBytes !== null && s.downloadedBytes !== undefined && s.phase !== "Ready") {
    const pct = Math.min(100, (100 * s.downloadedBytes) / s.totalBytes);
    let text = `${pct.toFixed(0)}% of ${bytes(s.totalBytes)}`;
    if (s.downloadRate > 0) {
      const left = Math.round((s.totalBytes - s.downloadedBytes) / s.downloadRate);
      text += ` · ${bytes(s.downloadRate)}/s · ${Math.floor(left / 60)}m${String(left % 60).padStart(2, "0")}s left`;
    }
    const bar = el("div", { class: "progress", "data-downloaded": s.downloadedBytes }, el("div", {}));
    bar.firstChild.style.width = pct + "%";
    box.append(bar, el("div", { class: "dim" }, text));
  }
  return box;
}

function drawDeployments(state) {
  const root = document.getElementById("deployments");
  root.replaceChildren();
  if (state.deployments.length === 0) root.append(el("p", { class: "dim" }, "No ModelDeployments yet."));
  for (const d of state.deployments) {
    const cls = d.readyReplicas >= d.replicas && d.replicas > 0 ? "ready-all" : d.readyReplicas > 0 ? "ready-some" : "ready-none";
    const card = el("div", {
      class: "deployment", "data-deployment": `${d.namespace}/${d.name}`,
      "data-ready-replicas": d.readyReplicas, "data-replicas": d.replicas,
    },
      el("div", { class: "title" },
        el("span", { class: "name" }, `${d.namespace}/${d.name}`),
        el("span", { class: "dim" }, `model ${d.model}`),
        el("span", { class: cls }, `${d.readyReplicas}/${d.replicas} ready`),
        d.endpoint ? el("span", { class: "dim" }, d.endpoint) : null));
    const conditions = el("div", { class: "conditions" });
    for (const c of d.conditions) {
      // Progressing says what is under way, neither good nor bad.
      const good = (c.type === "Degraded" || c.type === "Conflicted") ? c.status !== "True" : c.status === "True";
      const kind = c.type === "Progressing" ? "" : good ? " good" : " bad";
      conditions.append(el("span", {
        class: "condition" + kind, title: `${c.reason}: ${c.message}`,
        "data-condition": c.type, "data-status": c.status,
      }, `${c.type}: ${c.status}` + (c.reason ? ` (${c.reason})` : "")));
    }
    card.append(conditions, trafficLine(d, state));
    for (const inst of d.instances) {
      const row = el("div", { class: "instance", "data-instance": `${d.namespace}/${d.name}#${inst.index}` },
        el("span", { class: "dim" }, `#${inst.index}`));
      inst.stages.forEach((s, i) => {
        if (i > 0) row.append(el("span", { class: "arrow" }, "→"));
        row.append(stageBox(s, i));
      });
      card.append(row);
    }
    root.append(card);
  }
}

// ---- nodes ----------------------------------------------------------------

function drawNodes(state) {
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren();
  for (const n of state.nodes) {
    const word = readyWord(n.ready);
    const mem = el("div", {}, `${bytes(n.usedBytes)} / ${bytes(n.allocatableBytes)}`);
    const bar = el("div", { class: "bar" }, el("div", {}));
    if (n.allocatableBytes) bar.firstChild.style.width = Math.min(100, (100 * n.usedBytes) / n.allocatableBytes) + "%";
    mem.append(bar);
    body.append(el("tr", { "data-node-row": n.name, "data-ready": n.ready },
      el("td", {}, n.name),
      el("td", { class: "state-" + word }, n.ready + (n.unschedulable ? ", cordoned" : "")),
      el("td", {}, mem),
      el("td", {}, [n.chip, n.accelerator].filter(v => v && v !== "None").join(" · ") || "–"),
      el("td", {}, n.engines.join(", ") || "–"),
      el("td", {}, n.cachedModels.map(([k, b]) => `${k} (${bytes(b)})`).join(", ") || "–")));
  }
}

// ---- polling --------------------------------------------------------------

let lastGood = null;

async function poll() {
  const problem = document.getElementById("problem");
  try {
    const r = await fetch("/ui/api/state", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}: ${(await r.text()).trim()}`);
    const state = await r.json();
    const problems = [state.error, state.trafficError && "gateway metrics: " + state.trafficError].filter(Boolean);
    problem.hidden = problems.length === 0;
    problem.textContent = problems.join(" · ");
    if (state.nodes) {
      lastGood = new Date();
      drawTopology(state);
      drawDeployments(state);
      drawNodes(state);
      const ready = state.nodes.filter(n => readyWord(n.ready) === "Ready").length;
      document.getElementById("summary").textContent =
        `${state.nodes.length} nodes (${ready} ready) · ${state.deployments.length} deployments · updated ${lastGood.toLocaleTimeString()}`;
    }
  } catch (e) {
    problem.hidden = false;
    problem.textContent = `cannot reach the operator: ${e.message}` + (lastGood ? ` (showing ${lastGood.toLocaleTimeString()})` : "");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
