// turnkv dashboard: polls dashboard/state about once a second and redraws the panels in place.
// No libraries, nothing loaded from anywhere but this server; draw.js has the drawing primitives.
"use strict";
(() => {
  const POLL_MS = 1000;
  const STALE_MS = 4000;
  const KEY_STORE = "turnkv.dashboard.key";
  const $ = (id) => document.getElementById(id);
  const { el, bytes, num, secs, duration, pct, plural, value, facts, badge, legend, chart } = window.TurnkvDraw;

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

  // -- panels --------------------------------------------------------------------------------------
  function kpi(label, val, sub, extra) {
    const k = el("div", { class: "kpi" + (extra && extra.bad ? " bad" : ""), title: extra && extra.title },
      el("div", { class: "label", text: label }), el("div", { class: "value", text: val }), el("div", { class: "sub", text: sub }));
    if (extra && extra.gauge) k.append(extra.gauge);
    return k;
  }

  function renderKpis(s) {
    const b = s.health.bank, m = s.memory, r = s.requests;
    const gauge = el("div", { class: "gauge", title: "banked and live bytes against the budget" },
      el("span", { class: "g-banked" }), el("span", { class: "g-live" }));
    gauge.children[0].style.width = Math.min(100, (100 * b.unique_bytes) / b.budget_bytes) + "%";
    gauge.children[1].style.width = Math.min(100, (100 * m.live_bytes) / b.budget_bytes) + "%";
    const saved = m.logical_bytes - b.unique_bytes;
    $("kpis").replaceChildren(
      kpi("Bank memory", bytes(b.unique_bytes), pct(b.unique_bytes + m.live_bytes, b.budget_bytes) + " of " + bytes(b.budget_bytes),
        { gauge, title: "unique KV bytes held by the bank; live turns add " + bytes(m.live_bytes) }),
      kpi("As private copies", bytes(m.logical_bytes),
        b.unique_bytes > 0 ? num(m.logical_bytes / b.unique_bytes, 2) + "× · saves " + bytes(Math.max(saved, 0)) : "nothing banked",
        { title: "what the banked rows would cost if every conversation held its own copy" }),
      kpi("Conversations", num(b.entries), plural(m.segments, "segment") + " · " + num(m.shared_segments) + " shared"),
      kpi("Hit rate", pct(b.hits, b.hits + b.misses), plural(b.hits, "hit") + " · " + num(b.misses) + (b.misses === 1 ? " miss" : " misses")),
      kpi("Evictions", num(b.evictions), "dropped for room", { title: "idle entries evicted to make room" }),
      kpi("507 refusals", num(b.refusals), "turns that did not fit", { bad: b.refusals > 0 }),
      kpi("Tokens/s", num(r.tokens_per_s, 1),
        r.live.length ? "live turns: " + num(r.live_rows_per_s, 1) + " rows/s" : "+ " + num(r.prefill_tokens_per_s, 0) + " prefill · 5 s",
        { title: "tokens generated per second over the last 5 s, counted as turns finish; rows/s of the turns running now" }),
      kpi("First token", secs(r.ttft_s !== null ? r.ttft_s : r.ttft_mean_s), "mean " + secs(r.ttft_mean_s) + " · " + num(r.answers) + " answers",
        { title: "time to first token: mean over the last minute (big) and since the start" }),
      kpi("Queue", num(r.running) + " · " + num(r.waiting), "running · waiting"),
    );
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
    legend($("memlegend"), [
      ["c-banked", "banked (unique)"], ["c-live", "live turns"], ["c-logical", "as private copies"],
      ["c-budget", budgetShown ? "budget" : "budget " + bytes(b.budget_bytes) + " (off scale)"],
    ]);
    chart($("tokchart"), h.t, [
      { cls: "s-gen", kind: "bars", values: h.generated_tok_s },
      { cls: "s-prefill", kind: "bars", values: h.prefilled_tok_s, base: h.generated_tok_s },
    ], { fmt: (v) => num(v, 0) });
    legend($("toklegend"), [["c-gen", "generated"], ["c-prefill", "prefilled"],
      ["", "(counted when a turn finishes)"]]);
    const ev = ["hits", "misses", "evictions", "refusals"];
    let base = h.t.map(() => 0);
    const evSeries = ev.map((k) => {
      const s2 = { cls: "s-" + k, kind: "bars", values: h[k], base };
      base = base.map((v, i) => v + h[k][i]);
      return s2;
    });
    chart($("evchart"), h.t, evSeries, { fmt: (v) => num(v, 1) });
    legend($("evlegend"), [["c-hits", "hits"], ["c-misses", "misses"], ["c-evictions", "evictions"], ["c-refusals", "507 refusals"]]);
  }

  function renderConversations(s) {
    const box = $("convs");
    const convs = s.conversations;
    const bpr = s.memory.bytes_per_row;
    $("convcount").textContent = s.conversations_total === convs.length
      ? s.conversations_total + " banked · most recent first"
      : s.conversations_total + " banked · the " + convs.length + " most recent";
    legend($("seglegend"), [["c-own", "segment of this conversation only (rows)"],
      ["c-shared", "segment shared with another conversation or a live turn"], ["c-partial", "only a prefix of the segment is used"]]);
    if (!convs.length) {
      box.replaceChildren(el("div", { class: "none", text: "Nothing banked yet: each finished turn appears here." }));
      return;
    }
    const maxRows = Math.max(1, ...convs.map((c) => c.rows));
    const width = box.clientWidth || 600;
    box.replaceChildren(...convs.map((c) => {
      const meta = el("div", { class: "meta" },
        el("span", { class: "name", text: "#" + c.id }),
        el("span", { class: "chip mono", title: "cache namespace (a short hash)", text: "ns " + c.ns_hash }),
        el("span", { text: plural(c.rows, "row") + " in " + plural(c.segments.length, "segment") }),
        el("span", { text: bytes(c.rows * bpr) + " as a copy" }),
        el("span", { title: "bytes of the segments no one else holds", text: "frees " + bytes(c.own_bytes) + " if evicted" }),
        c.in_use ? el("span", { class: "chip pin", text: "in use", title: "a live turn continues this conversation" }) : null,
        c.protected && !c.in_use ? el("span", { class: "chip", text: "protected", title: "a session's newest entry: never evicted" }) : null);
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
    const r = s.requests, sched = s.health.scheduler, q = s.health.queue;
    const rows = [["running", num(r.running)], ["waiting", num(r.waiting)]];
    if (sched && typeof sched === "object") {
      const order = ["step_ms", "rows_per_step", "graphs"];
      const keys = order.filter((k) => k in sched).concat(Object.keys(sched).filter((k) => !order.includes(k) && k !== "running" && k !== "waiting"));
      for (const k of keys) rows.push([k.replace(/_/g, " "), value(k, sched[k])]);
    } else {
      rows.push(["scheduler", el("span", { class: "muted", text: q ? "one engine worker: turns run one at a time" : "not reported" })]);
    }
    rows.push(["tokens/s (5 s)", num(r.tokens_per_s, 1) + " generated · " + num(r.prefill_tokens_per_s, 0) + " prefilled"]);
    rows.push(["live rows/s", num(r.live_rows_per_s, 1), "rows the running turns added per second since this page's server first saw them"]);
    rows.push(["TTFT", "last minute " + secs(r.ttft_s) + " · mean " + secs(r.ttft_mean_s)]);
    rows.push(["finished", num(r.answers) + " answers · " + num(r.generated_tokens) + " generated · " + num(r.prefilled_tokens) + " prefilled tokens"]);
    facts($("queue"), rows);
    const box = $("live");
    if (!r.live.length) {
      box.replaceChildren(el("div", { class: "none", text: "No turn running." }));
      return;
    }
    const head = el("tr", {}, ...["ns", "rows", "restored", "rows/s", "priced", "age"].map((h) => el("th", { text: h })));
    box.replaceChildren(el("table", { class: "live" }, el("thead", {}, head), el("tbody", {}, ...r.live.map((t) =>
      el("tr", {}, el("td", { class: "mono", text: t.ns_hash }), el("td", { text: num(t.rows) }), el("td", { text: num(t.restored_rows) }),
        el("td", { text: num(t.rows_per_s, 1) }), el("td", { text: bytes(t.priced_bytes) }), el("td", { text: num(t.age_s, 1) + " s" }))))));
  }

  function renderAttention(s) {
    const a = s.health.attention;
    const rows = [
      ["route", badge(a.route, a.route === "fused" ? "ok" : "warn")],
      ["verdict", badge(a.verdict, a.verdict === "ok" ? "ok" : a.verdict === "selfcheck_failed" ? "bad" : "warn")],
      ["reason", a.reason],
    ];
    const sc = a.selfcheck;
    if (sc && typeof sc === "object") {
      rows.push(["self-check", badge(sc.passed ? "passed" : "failed", sc.passed ? "ok" : "bad")]);
      rows.push(["worst error", num(sc.worst_tol_ratio, 3) + "× tolerance (" + (sc.dtype || "?") + ")"]);
      rows.push(["probes", num((sc.shapes || []).length) + " shapes in " + secs(sc.seconds)]);
    } else {
      rows.push(["self-check", el("span", { class: "muted", text: "not run" })]);
    }
    facts($("attention"), rows);
    const counts = Object.entries(s.health.segments.route_counts || {}).sort((x, y) => y[1] - x[1]);
    const box = $("routes");
    if (!counts.length) {
      box.replaceChildren(el("div", { class: "none", text: "No attention call yet." }));
      return;
    }
    const top = counts[0][1];
    const grid = el("div", { class: "hbars" });
    for (const [label, n] of counts.slice(0, 14)) {
      const fill = el("div", { class: "fill" });
      fill.style.width = (100 * n) / top + "%";
      grid.append(el("span", { class: "mono", text: label }), el("div", { class: "track" }, fill), el("span", { class: "n", text: num(n) }));
    }
    box.replaceChildren(grid);
  }

  function renderTiers(s) {
    const g = s.health.segments;
    facts($("segments"), [["seals", num(g.seals)], ["merges", num(g.merges)], ["most segments", num(g.max_segments), "most segments one conversation held"],
      ["shared", plural(s.memory.shared_segments, "segment") + ", " + bytes(s.memory.shared_bytes)]]);
    const d = s.health.disk;
    if (!d) facts($("disk"), [["disk tier", el("span", { class: "muted", text: "not reported" })]]);
    else if (!d.enabled) facts($("disk"), [["disk tier", el("span", { class: "muted", text: "off" })]]);
    else facts($("disk"), Object.entries(d).filter(([k]) => k !== "enabled").map(([k, v]) => [k, value(k, v)]));
    const sp = s.health.speculation;
    if (!sp) {
      facts($("spec"), [["speculation", el("span", { class: "muted", text: "not reported" })]]);
    } else {
      const rows = Object.entries(sp).filter(([k]) => k !== "by_window" && k !== "acceptance").map(([k, v]) => [k, value(k, v)]);
      if ("drafted" in sp && "accepted" in sp) rows.push(["acceptance", pct(sp.accepted, sp.drafted)]);
      // per verify-window size: accepted of drafted, only sizes that ran
      const used = Object.entries(sp.by_window || {}).filter(([, w]) => w.windows > 0);
      if (used.length) rows.push(["by window rows", used.map(([b, w]) => `${b}: ${num(w.accepted)}/${num(w.drafted)}`).join(", ")]);
      facts($("spec"), rows);
    }
  }

  // A panel is rebuilt only when what it shows changed, so hover tooltips survive the polling.
  const shown = {};
  function panel(name, inputs, draw, s) {
    const key = JSON.stringify(inputs) + "|" + window.innerWidth;
    if (shown[name] === key) return;
    shown[name] = key;
    draw(s);
  }

  function render(s) {
    const hl = s.health;
    $("model").textContent = hl.model + " · " + hl.device + " · " + hl.kv_layout + " KV · up " + duration(s.uptime_s);
    panel("kpis", [hl.bank, s.memory, s.requests], renderKpis, s);
    renderCharts(s); // the time axis moves every second
    panel("convs", [s.conversations, s.conversations_total, s.memory.bytes_per_row], renderConversations, s);
    panel("queue", [s.requests, hl.scheduler, hl.queue], renderQueue, s);
    panel("attention", [hl.attention, hl.segments], renderAttention, s);
    panel("tiers", [hl.segments, hl.disk, hl.speculation, s.memory], renderTiers, s);
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
    resizeTimer = setTimeout(() => lastState && render(lastState), 150);
  });
  poll();
})();
