// turnkv dashboard, drawing primitives: DOM and SVG builders, number formats, the time chart.
// Plain DOM and SVG, no libraries; app.js uses them through window.TurnkvDraw.
"use strict";
window.TurnkvDraw = (() => {
  const WINDOW_S = 300; // the server keeps five minutes of history
  const MIN_WINDOW_S = 60; // a young server's charts span at least a minute
  const SVG_NS = "http://www.w3.org/2000/svg"; // the SVG namespace name: an identifier, never fetched

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "text") e.textContent = v;
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid);
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v;
      else e.setAttribute(k, String(v));
    }
    return e;
  }
  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
  function bytes(n) {
    if (n === null || n === undefined) return "—";
    let i = 0;
    let v = Math.abs(n);
    while (v >= 1024 && i < UNITS.length - 1) { v /= 1024; i++; }
    // digits by the rounded value, so 9.999 reads "10.0", not "10.00"
    const s = i === 0 ? String(Math.round(v)) : v.toFixed(v < 9.995 ? 2 : v < 99.95 ? 1 : 0);
    return (n < 0 ? "-" : "") + s + " " + UNITS[i];
  }
  function num(n, digits) {
    if (n === null || n === undefined) return "—";
    if (typeof n !== "number") return String(n);
    return n.toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 2 : digits });
  }
  function secs(s) {
    if (s === null || s === undefined) return "—";
    return s < 1 ? num(s * 1000, 0) + " ms" : num(s, 2) + " s";
  }
  function duration(s) {
    s = Math.floor(s);
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }
  function pct(a, b) { return b > 0 ? num((100 * a) / b, 1) + " %" : "—"; }
  function plural(n, word) { return num(n) + " " + word + (n === 1 ? "" : "s"); }
  // Any value of /health shown generically (future keys render without a code change).
  function value(key, v) {
    if (v === null || v === undefined) return "—";
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (typeof v === "number") return key.includes("bytes") ? bytes(v) : num(v);
    if (Array.isArray(v)) return v.map((x) => value(key, x)).join(", ") || "none";
    if (typeof v === "object") {
      const parts = Object.entries(v).map(([k, x]) => k + " " + value(k, x));
      return parts.join(", ") || "none";
    }
    return String(v);
  }
  function facts(box, rows) {
    box.replaceChildren();
    for (const [k, v, title] of rows) box.append(el("dt", { text: k, title }), el("dd", {}, v));
  }
  function badge(text, kind, title) { return el("span", { class: "badge " + kind, text, title }); }
  // A round axis maximum: 1, 2, 2.5 or 5 times a power of ten (of 1024 for bytes).
  function niceMax(v, binary) {
    if (!(v > 0)) return 1;
    let unit = 1;
    if (binary) while (v / unit >= 1024) unit *= 1024;
    const x = v / unit;
    const p = Math.pow(10, Math.floor(Math.log10(x)));
    const m = [1, 2, 2.5, 5, 10].find((k) => k * p >= x);
    return m * p * unit;
  }

  // -- charts --------------------------------------------------------------------------------------
  // series: {cls, kind: "area" | "line" | "bars", values, base (optional lower values for a band)}
  function chart(box, t, series, opts) {
    const w = Math.max(box.clientWidth, 160);
    const h = Math.max(box.clientHeight, 60);
    const padL = 62, padR = 6, padT = 8, padB = 18;
    const root = svg("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}` });
    const now = t.length ? t[t.length - 1] : Date.now() / 1000;
    const span = Math.min(WINDOW_S, Math.max(MIN_WINDOW_S, t.length ? now - t[0] : 0));
    const t0 = now - span;
    const x = (ti) => padL + ((ti - t0) / span) * (w - padL - padR);
    let top = opts.ymax || 0;
    for (const s of series) {
      if (s.hidden) continue;
      for (let i = 0; i < s.values.length; i++) top = Math.max(top, s.values[i] + (s.base ? s.base[i] : 0));
    }
    const ymax = niceMax(top * 1.05, opts.binary);
    const y = (v) => h - padB - (Math.min(v, ymax) / ymax) * (h - padT - padB);
    for (const f of [0, 0.5, 1]) {
      const yy = y(ymax * f);
      root.append(svg("line", { class: "gridline", x1: padL, x2: w - padR, y1: yy, y2: yy }));
      // all zeros (or no data yet): only the zero is labelled, a scale of nothing would mislead
      if (top > 0 || f === 0) root.append(svg("text", { class: "axis", x: padL - 6, y: yy + 4, "text-anchor": "end", text: opts.fmt(ymax * f) }));
    }
    const ago = (dt) => "−" + (dt >= 120 ? num(dt / 60, 1) + " min" : Math.round(dt) + " s");
    for (const [label, dt, anchor] of [[ago(span), span, "start"], [ago(span / 2), span / 2, "middle"], ["now", 0, "end"]]) {
      root.append(svg("text", { class: "axis", x: x(now - dt), y: h - 3, "text-anchor": anchor, text: label }));
    }
    const step = (w - padL - padR) / span;
    for (const s of series) {
      if (s.hidden || !t.length) continue;
      const base = (i) => (s.base ? s.base[i] : 0);
      if (s.kind === "bars") {
        const bw = Math.max(Math.min(step * 0.8, 8), 1);
        for (let i = 0; i < t.length; i++) {
          if (!(s.values[i] > 0)) continue;
          const y1 = y(base(i) + s.values[i]);
          root.append(svg("rect", { class: s.cls, x: x(t[i]) - bw, y: y1, width: bw, height: Math.max(y(base(i)) - y1, 1) }));
        }
        continue;
      }
      const pts = t.map((ti, i) => `${x(ti).toFixed(1)},${y(base(i) + s.values[i]).toFixed(1)}`);
      if (s.kind === "area") {
        const under = t.map((ti, i) => `${x(ti).toFixed(1)},${y(base(i)).toFixed(1)}`).reverse();
        root.append(svg("polygon", { class: s.cls + " area", points: pts.concat(under).join(" ") }));
      } else {
        root.append(svg("polyline", { class: s.cls + " line", points: pts.join(" ") }));
      }
    }
    if (!t.length) root.append(svg("text", { class: "empty", x: w / 2, y: h / 2, "text-anchor": "middle", text: "waiting for data…" }));
    box.replaceChildren(root);
  }

  return { el, svg, bytes, num, secs, duration, pct, plural, value, facts, badge, chart };
})();
