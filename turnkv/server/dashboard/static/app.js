// turnkv dashboard: polls dashboard/state about once a second and fills in the panels in place.
// The layout is index.html's, there before any data; the glossary there (#help) is also the source
// of every tooltip. Status colours come from the state's `features` (decided on the server, once).
// No libraries, nothing loaded from anywhere but this server; draw.js has the drawing primitives.
"use strict";
(() => {
  const POLL_MS = 1000;
  const STALE_MS = 4000;
  const KEY_STORE = "turnkv.dashboard.key";
  const $ = (id) => document.getElementById(id);
  const { el, bytes, num, secs, duration, pct, plural, value, facts, badge, chart } = window.TurnkvDraw;

  let apiKey = sessionStorage.getItem(KEY_STORE) || "";
  let timer = null;
  let lastOk = 0;
  let lastState = null;

  // /dashboard#key=KEY: take the key from the fragment (never sent to the server) and drop it.
  const frag = /(?:^#|&)key=([^&]*)/.exec(location.hash);
  if (frag) {
    apiKey = decodeURIComponent(frag[1]);
    sessionStorage.setItem(KEY_STORE, apiKey);
    history.replaceState(null, "", location.pathname + location.search);
  }

  // -- the glossary: plain words for every term, shown as tooltips ----------------------------------
  const HELP = new Map();
  for (const dt of document.querySelectorAll("#help dt[data-term]")) {
    const text = dt.nextElementSibling.textContent.replace(/\s+/g, " ").trim();
    for (const term of dt.dataset.term.split(" ")) HELP.set(term, text);
  }
  const help = (term) => HELP.get(term) || HELP.get(String(term).replace(/ /g, "_"));
  function routeHelp(label) {
    const m = /^([a-z]+)_(?:q(\d+)|prefill)$/.exec(label);
    if (!m) return help(label);
    const rows = m[2] ? plural(+m[2], "query row") + (m[2] === "1" ? " (decoding one token)" : "") : "a long prompt chunk";
    return m[1] + ": " + (help(m[1]) || "an attention route") + " Calls over " + rows + ", one per layer.";
  }
  for (const e of document.querySelectorAll("[data-help]")) e.title = help(e.dataset.help) || "";
  // facts rows: [label, value, tooltip]; the tooltip defaults to the glossary's entry for the label
  const explained = (rows) => rows.map(([k, v, title]) => [k, v, title || help(k)]);

  // -- panels --------------------------------------------------------------------------------------
  const TONE_WORDS = { ok: "on and working", off: "off, as expected here", warn: "degraded", bad: "a fault" };
  const fbadge = (f) => badge(f.text, f.tone, f.label + ": " + f.why + " (" + TONE_WORDS[f.tone] + ")");

  function renderFeatures(s) {
    $("features").replaceChildren(...s.features.map((f) =>
      el("span", { class: "feature", "data-feature": f.key, "data-tone": f.tone }, el("span", { class: "flabel", text: f.label }), fbadge(f))));
  }

  function setKpi(name, val, sub, opts) {
    const k = document.querySelector(`[data-kpi="${name}"]`);
    k.querySelector(".value").textContent = val;
    k.querySelector(".sub").textContent = sub;
    k.classList.toggle("bad", !!(opts && opts.bad));
    if (opts && opts.title) k.title = opts.title;
  }

  function renderKpis(s) {
    const b = s.health.bank, m = s.memory, r = s.requests;
    const gauge = document.querySelector("[data-kpi=bank] .gauge").children;
    gauge[0].style.width = Math.min(100, (100 * b.unique_bytes) / b.budget_bytes) + "%";
    gauge[1].style.width = Math.min(100, (100 * m.live_bytes) / b.budget_bytes) + "%";
    const saved = m.logical_bytes - b.unique_bytes;
    setKpi("bank", bytes(b.unique_bytes), pct(b.unique_bytes + m.live_bytes, b.budget_bytes) + " of " + bytes(b.budget_bytes),
      { title: help("bank") + " Live turns add " + bytes(m.live_bytes) + "." });
    setKpi("copies", bytes(m.logical_bytes),
      b.unique_bytes > 0 ? num(m.logical_bytes / b.unique_bytes, 2) + "× · saves " + bytes(Math.max(saved, 0)) : "nothing banked");
    setKpi("convs", num(b.entries), plural(m.segments, "segment") + " · " + num(m.shared_segments) + " shared");
    setKpi("hits", pct(b.hits, b.hits + b.misses), plural(b.hits, "hit") + " · " + num(b.misses) + (b.misses === 1 ? " miss" : " misses"));
    setKpi("evictions", num(b.evictions), "dropped for room");
    setKpi("refusals", num(b.refusals), "turns that did not fit", { bad: b.refusals > 0 });
    setKpi("tokens", num(r.tokens_per_s, 1),
      r.live.length ? "live turns: " + num(r.live_rows_per_s, 1) + " rows/s" : "+ " + num(r.prefill_tokens_per_s, 0) + " prefill · 5 s");
    setKpi("ttft", secs(r.ttft_s !== null ? r.ttft_s : r.ttft_mean_s), "mean " + secs(r.ttft_mean_s) + " · " + num(r.answers) + " answers");
    setKpi("queue", num(r.running) + " · " + num(r.waiting), "running · waiting");
  }

  function renderCharts(s) {
    const h = s.history, b = s.health.bank;
    const live = h.live_bytes;
    const maxData = Math.max(0, ...h.banked_bytes.map((v, i) => v + live[i]), ...h.logical_bytes);
    const budgetShown = b.budget_bytes <= maxData * 2.5;
    chart($("memchart"), h.t, [
      { cls: "s-banked", kind: "area", values: h.banked_bytes },
      { cls: "s-live", kind: "area", values: live, base: h.banked_bytes },
      { cls: "s-logical", kind: "line", values: h.logical_bytes },
      { cls: "s-budget", kind: "line", values: h.t.map(() => b.budget_bytes), hidden: !budgetShown },
    ], { fmt: bytes, binary: true });
    $("budgetlabel").textContent = budgetShown ? "budget" : "budget " + bytes(b.budget_bytes) + " (off scale)";
    chart($("tokchart"), h.t, [
      { cls: "s-gen", kind: "bars", values: h.generated_tok_s },
      { cls: "s-prefill", kind: "bars", values: h.prefilled_tok_s, base: h.generated_tok_s },
    ], { fmt: (v) => num(v, 0) });
    const ev = ["hits", "misses", "evictions", "refusals"];
    let base = h.t.map(() => 0);
    const evSeries = ev.map((k) => {
      const s2 = { cls: "s-" + k, kind: "bars", values: h[k], base };
      base = base.map((v, i) => v + h[k][i]);
      return s2;
    });
    chart($("evchart"), h.t, evSeries, { fmt: (v) => num(v, 1) });
  }

  function renderConversations(s) {
    const box = $("convs");
    const convs = s.conversations;
    const bpr = s.memory.bytes_per_row;
    $("convcount").textContent = s.conversations_total === convs.length
      ? s.conversations_total + " banked · most recent first"
      : s.conversations_total + " banked · the " + convs.length + " most recent";
    if (!convs.length) {
      box.replaceChildren(el("div", { class: "none", text: "Nothing banked yet: each finished turn appears here." }));
      return;
    }
    const maxRows = Math.max(1, ...convs.map((c) => c.rows));
    const width = box.clientWidth || 600;
    box.replaceChildren(...convs.map((c) => {
      const meta = el("div", { class: "meta" },
        el("span", { class: "name", text: "#" + c.id }),
        el("span", { class: "chip mono", title: help("ns"), text: "ns " + c.ns_hash }),
        el("span", { title: help("row"), text: plural(c.rows, "row") + " in " + plural(c.segments.length, "segment") }),
        el("span", { title: help("copies"), text: bytes(c.rows * bpr) + " as a copy" }),
        el("span", { title: "bytes of the segments no one else holds", text: "frees " + bytes(c.own_bytes) + " if evicted" }),
        c.in_use ? el("span", { class: "chip pin", text: "in use", title: help("in_use") }) : null,
        c.protected && !c.in_use ? el("span", { class: "chip", text: "protected", title: help("protected") }) : null);
      const bar = el("div", { class: "bar" });
      bar.style.width = Math.max(2, (100 * c.rows) / maxRows) + "%";
      let alt = false;
      for (const g of c.segments) {
        const partial = g.rows < g.segment_rows;
        const cls = "seg" + (g.shared ? " shared" : alt ? " alt" : "") + (partial ? " partial" : "");
        alt = !alt;
        const tip = "segment " + g.id + ": " + num(g.rows) + (partial ? " of " + num(g.segment_rows) : "") + " rows, " +
          bytes(g.bytes) + (g.shared ? ", shared" : "");
        const px = (width * g.rows) / maxRows;
        const d = el("div", { class: cls, title: tip, "data-shared": g.shared ? "1" : "0", text: px >= 30 ? num(g.rows) : "" });
        d.style.flex = g.rows + " 1 0px";
        bar.append(d);
      }
      return el("div", { class: "conv", "data-conv": c.id, "data-rows": c.rows }, meta, bar);
    }));
  }

  function renderQueue(s) {
    const r = s.requests, sched = s.health.scheduler, q = s.health.queue, F = s.features;
    const rows = [["running", num(r.running), help("live")], ["waiting", num(r.waiting)]];
    if (sched && typeof sched === "object") {
      const order = ["step_ms", "rows_per_step", "graphs", "run_ahead"];
      const keys = order.filter((k) => k in sched).concat(Object.keys(sched).filter((k) => !order.includes(k) && k !== "running" && k !== "waiting"));
      for (const k of keys) {
        const v = sched[k];
        // on/off fields show their classified state; their counters follow in words
        if (k in F && v && typeof v === "object") {
          const counts = Object.entries(v).filter(([c]) => c !== "status" && c !== "enabled").map(([c, x]) => c + " " + value(c, x)).join(", ");
          rows.push([F[k].label, el("span", {}, fbadge(F[k]), counts ? " " + counts : ""), help(k)]);
        } else {
          rows.push([k.replace(/_/g, " "), value(k, v), help(k)]);
        }
      }
    } else {
      rows.push(["scheduler", el("span", { class: "muted", text: q ? "one engine worker: turns run one at a time" : "not reported" })]);
    }
    rows.push(["tokens/s (5 s)", num(r.tokens_per_s, 1) + " generated · " + num(r.prefill_tokens_per_s, 0) + " prefilled", help("generated")]);
    rows.push(["live rows/s", num(r.live_rows_per_s, 1), "rows the running turns added per second since this page's server first saw them"]);
    rows.push(["TTFT", "last minute " + secs(r.ttft_s) + " · mean " + secs(r.ttft_mean_s), help("ttft")]);
    rows.push(["finished", num(r.answers) + " answers · " + num(r.generated_tokens) + " generated · " + num(r.prefilled_tokens) + " prefilled tokens"]);
    facts($("queue"), explained(rows));
    const box = $("live");
    if (!r.live.length) {
      box.replaceChildren(el("div", { class: "none", text: "No turn running." }));
      return;
    }
    const cols = [["ns", help("ns")], ["rows", help("row")], ["restored", "rows taken from the bank instead of computed"],
      ["rows/s", "rows added per second"], ["priced", "bytes reserved for the turn when it was admitted"], ["age", ""]];
    const head = el("tr", {}, ...cols.map(([h, title]) => el("th", { text: h, title: title || null })));
    box.replaceChildren(el("table", { class: "live" }, el("thead", {}, head), el("tbody", {}, ...r.live.map((t) =>
      el("tr", {}, el("td", { class: "mono", text: t.ns_hash }), el("td", { text: num(t.rows) }), el("td", { text: num(t.restored_rows) }),
        el("td", { text: num(t.rows_per_s, 1) }), el("td", { text: bytes(t.priced_bytes) }), el("td", { text: num(t.age_s, 1) + " s" }))))));
  }

  function renderAttention(s) {
    const a = s.health.attention, F = s.features;
    const tone = a.route === "fused" ? "ok" : F.attention.tone; // the route follows from the verdict
    const rows = [
      [F.attention.label, fbadge(F.attention), help("fused")],
      ["route", badge(a.route, tone, help(a.route))],
      ["verdict", el("span", { class: "mono tone-" + F.attention.tone, text: a.verdict }), help("verdict")],
      ["reason", a.reason],
      ["self-check", fbadge(F.selfcheck), help("selfcheck")],
    ];
    const sc = a.selfcheck;
    if (sc && typeof sc === "object") {
      rows.push(["worst error", num(sc.worst_tol_ratio, 3) + "× tolerance (" + (sc.dtype || "?") + ")"]);
      rows.push(["probes", num((sc.shapes || []).length) + " shapes in " + secs(sc.seconds)]);
    }
    if (F.cpu_kernel) rows.push([F.cpu_kernel.label, fbadge(F.cpu_kernel), help("cpu_kernel")]);
    facts($("attention"), rows);
    const counts = Object.entries(s.health.segments.route_counts || {}).sort((x, y) => y[1] - x[1]);
    const box = $("routes");
    if (!counts.length) {
      box.replaceChildren(el("div", { class: "none", text: "No attention call yet." }));
      return;
    }
    const top = counts[0][1];
    const grid = el("div", { class: "hbars", title: help("route_q") });
    for (const [label, n] of counts.slice(0, 14)) {
      const fill = el("div", { class: "fill" });
      fill.style.width = (100 * n) / top + "%";
      grid.append(el("span", { class: "mono", "data-route": label, title: routeHelp(label), text: label }),
        el("div", { class: "track" }, fill), el("span", { class: "n", text: num(n) }));
    }
    box.replaceChildren(grid, el("div", { class: "muted small route-note", text: "route_qN: calls over N query rows (q1 = decoding); hover a route for what it is" }));
  }

  function renderTiers(s) {
    const g = s.health.segments, F = s.features;
    facts($("segments"), explained([["seals", num(g.seals)], ["merges", num(g.merges)],
      ["most segments", num(g.max_segments), "most segments one conversation held (at most 12)"],
      ["shared", plural(s.memory.shared_segments, "segment") + ", " + bytes(s.memory.shared_bytes), help("shared")]]));
    const d = s.health.disk;
    const diskRows = [[F.disk.label, fbadge(F.disk), help("disk")]];
    if (d && d.enabled) diskRows.push(...Object.entries(d).filter(([k]) => k !== "enabled").map(([k, v]) => [k.replace(/_/g, " "), value(k, v)]));
    facts($("disk"), diskRows);
    const sp = s.health.speculation;
    const rows = [[F.speculation.label, fbadge(F.speculation), help("speculation")]];
    if (sp) {
      rows.push(...Object.entries(sp).filter(([k]) => !["by_window", "acceptance", "status"].includes(k)).map(([k, v]) => [k.replace(/_/g, " "), value(k, v), help(k)]));
      if ("drafted" in sp && "accepted" in sp) rows.push(["acceptance", pct(sp.accepted, sp.drafted), "accepted of drafted tokens"]);
      // per verify-window size: accepted of drafted, only sizes that ran
      const used = Object.entries(sp.by_window || {}).filter(([, w]) => w.windows > 0);
      if (used.length) rows.push(["by window rows", used.map(([b, w]) => `${b}: ${num(w.accepted)}/${num(w.drafted)}`).join(", "), help("by_window")]);
    }
    facts($("spec"), rows);
  }

  // A panel is rebuilt only when what it shows changed, so hover tooltips survive the polling.
  const shown = {};
  function panel(name, inputs, draw, s) {
    const key = JSON.stringify(inputs) + "|" + window.innerWidth;
    if (shown[name] === key) return;
    shown[name] = key;
    draw(s);
  }

  function render(state) {
    // features by key, for the panels that show one (the strip shows them all, in order)
    const s = { ...state, features: Object.fromEntries(state.features.map((f) => [f.key, f])) };
    const hl = s.health;
    $("model").textContent = hl.model + " · " + hl.device + " · " + hl.kv_layout + " KV · up " + duration(s.uptime_s);
    panel("features", [state.features], renderFeatures, state);
    panel("kpis", [hl.bank, s.memory, s.requests], renderKpis, s);
    renderCharts(s); // the time axis moves every second
    panel("convs", [s.conversations, s.conversations_total, s.memory.bytes_per_row], renderConversations, s);
    panel("queue", [s.requests, hl.scheduler, hl.queue, state.features], renderQueue, s);
    panel("attention", [hl.attention, hl.segments, state.features], renderAttention, s);
    panel("tiers", [hl.segments, hl.disk, hl.speculation, s.memory, state.features], renderTiers, s);
  }

  // Before the first state: the charts' empty frames (the rest of the layout is in index.html).
  function placeholders() {
    for (const id of ["memchart", "tokchart", "evchart"]) chart($(id), [], [], { fmt: () => "" });
  }

  // -- polling and the key -------------------------------------------------------------------------
  function setStatus(kind, text) {
    $("dot").className = "dot " + kind;
    $("status").textContent = text;
  }
  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(poll, POLL_MS);
  }
  function askKey(message) {
    clearTimeout(timer);
    $("main").hidden = true;
    $("keyform").hidden = false;
    $("keyerror").hidden = !message;
    $("keyerror").textContent = message || "";
    setStatus("down", "API key needed");
    $("key").focus();
  }
  async function poll() {
    let res;
    try {
      res = await fetch("dashboard/state", { headers: apiKey ? { Authorization: "Bearer " + apiKey } : {}, cache: "no-store" });
    } catch (e) {
      setStatus("down", "server unreachable · retrying");
      return schedule();
    }
    if (res.status === 401) {
      sessionStorage.removeItem(KEY_STORE);
      return askKey(apiKey ? "The server refused that key." : "");
    }
    if (!res.ok) {
      setStatus("down", "state: HTTP " + res.status + " · retrying");
      return schedule();
    }
    try {
      const s = await res.json();
      $("keyform").hidden = true;
      $("main").hidden = false;
      render(s);
      lastState = s;
      lastOk = Date.now();
      setStatus("live", "live · " + new Date(s.time * 1000).toLocaleTimeString());
    } catch (e) {
      console.error(e);
      setStatus("down", "cannot draw the state: " + e.message);
    }
    schedule();
  }

  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("key").value.trim();
    $("key").value = "";
    sessionStorage.setItem(KEY_STORE, apiKey);
    $("keyform").hidden = true;
    $("main").hidden = false;
    setStatus("", "connecting…");
    poll();
  });
  setInterval(() => {
    const dot = $("dot").classList;
    if (lastOk && Date.now() - lastOk > STALE_MS && (dot.contains("live") || dot.contains("stale"))) {
      setStatus("stale", "no update for " + Math.round((Date.now() - lastOk) / 1000) + " s");
    }
  }, 1000);
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => (lastState ? render(lastState) : placeholders()), 150);
  });
  placeholders();
  poll();
})();
