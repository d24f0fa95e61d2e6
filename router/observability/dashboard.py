"""The ``/dashboard`` page: one static HTML document, no external assets (works offline).

It polls ``/v1/cluster/state`` (the tables: each replica's health, load and cache now, and
its costs as the router's cost model has them) and
``/dashboard/history`` (router/observability/history.py: the bounded history) every ``REFRESH_MS`` and
draws the history as inline SVG line charts, each with a legend:

    * cluster charts, one line per replica: token hit ratio, TTFT p50 (solid) and p99
      (dashed), requests per second; and routing decisions per second by reason;
    * per replica: KV blocks (used, cached, free) and eviction-queue sizes.

Two hit ratios, named apart wherever they appear: the table's *block hit ratio* is the
replica's own (cached blocks / prompt blocks looked up, since the replica started); the
chart's *prompt-token hit ratio* is the router's (cached / prompt tokens of the requests
that finished in each interval). The panels fill the page's width (a flexible grid).

DOM contract (tests/e2e/test_dashboard_browser.py checks it in headless Chromium): every chart
is ``<svg class="chart" data-chart=NAME>`` holding one ``<path class="series"
data-series=LABEL data-points=N>`` per series, N the points drawn; its legend is the
``.legend`` element after it. A null value (no request in the interval, a static replica
without heartbeat) is a gap in the line, not a zero.
"""

DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>UniCache cluster</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 1.2em 1.5em; color: #222; background: #fafafa; }
 h1 { font-size: 1.3em; margin: 0 0 0.2em; }
 h2 { font-size: 1.05em; margin: 1.2em 0 0.4em; }
 #meta { color: #555; margin-bottom: 0.8em; }
 table { border-collapse: collapse; width: 100%; background: #fff; }
 th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.5em; text-align: right; font-size: 0.9em; }
 th:first-child, td:first-child { text-align: left; }
 .bar { display: flex; height: 0.9em; width: 12em; background: #e6e6e6; }
 .used { background: #d9534f; } .cached { background: #5bc0de; }
 .bad { color: #c00; font-weight: bold; }
 .queues { font-size: 0.85em; color: #444; text-align: left; min-width: 14em; }
 .grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 0.8em; margin-bottom: 0.8em; }
 .panel { box-sizing: border-box; background: #fff; border: 1px solid #ddd; border-radius: 4px; padding: 6px 8px; min-width: 0; }
 svg.chart { width: 100%; height: auto; display: block; }
 .panel h3 { font-size: 0.9em; margin: 0.1em 0 0.2em; font-weight: 600; }
 .legend { font-size: 0.8em; color: #333; display: flex; flex-wrap: wrap; gap: 0.3em 0.9em; }
 .legend span.sw { display: inline-block; width: 1.4em; height: 0; border-top: 3px solid; vertical-align: middle; margin-right: 0.3em; }
 .legend span.sw.dash { border-top-style: dashed; }
 svg.chart text { font-size: 10px; fill: #555; }
 svg.chart .axis { stroke: #999; stroke-width: 1; }
 svg.chart .gridline { stroke: #eee; stroke-width: 1; }
 svg.chart path.series { fill: none; stroke-width: 2; }
 .keyrow { font-size: 0.8em; color: #444; margin: 0.3em 0 0; }
 .keyrow span.box { display: inline-block; width: 0.9em; height: 0.9em; vertical-align: middle; margin: 0 0.3em 0 0.8em; }
</style>
</head>
<body>
<h1>UniCache cluster</h1>
<div id="meta">loading&hellip;</div>
<table>
 <thead><tr><th>replica</th><th>address</th><th>device</th><th>health</th><th>running</th><th>waiting</th>
 <th>blocks (used | cached | free)</th><th>capacity</th><th title="the replica's cached blocks / prompt blocks looked up, since it started">block hit ratio<br><small>replica, since start</small></th><th>evictions</th><th>host tier (used/cap, hit, promoted, demoted)</th><th>indexed</th>
 <th>eviction queues</th></tr></thead>
 <tbody id="rows"></tbody>
</table>
<div class="keyrow">blocks bar: <span class="box used"></span>used (held by requests)<span class="box cached"></span>cached
 (hold a reusable prefix)<span class="box" style="background:#e6e6e6"></span>rest free &middot; <b>block hit ratio</b>: the replica's cached
 blocks / prompt blocks looked up, since it started &middot; <b>prompt-token hit ratio</b> (chart below): the router's cached / prompt
 tokens of the requests finished in each interval</div>
<h2>Costs <small style="font-weight:normal;color:#666">(learned per backend: TTFT = base + per token &times; (uncached + queued tokens) + per request &times; outstanding)</small></h2>
<table id="costs">
 <thead><tr><th>replica</th><th>fitted</th><th>prefill base ms</th><th>prefill &mu;s / token</th><th>ms / outstanding request</th>
 <th>decode ms / step (base + per seq)</th><th>TTFT error (mean, relative)</th><th>predictions</th>
<th title="above 1: a request there has waited for its first token beyond the prediction's noise, and its TTFT costs are raised by this factor">overdue</th></tr></thead>
 <tbody id="cost-rows"></tbody>
</table>
<h2>Cluster <span id="span" style="font-weight:normal;color:#666"></span></h2>
<div class="grid" id="cluster-charts"></div>
<h2>Per replica</h2>
<div class="grid" id="replica-charts"></div>
<script>
const REFRESH_MS = 2000;
const COLORS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf'];
const QUEUE_NAMES = {evict_first: 'evict-first', chat: 'chat sessions', agent: 'agent sessions', structural: 'structural (templates)'};
const REASON_NAMES = {index_prefix: 'cached prefix (index)', inflight_prefix: 'prefix in flight', session_sticky: 'session (sticky)',
  session_home: 'session (home)', session_hash: 'session (hash)', template_home: 'template home', least_loaded: 'least loaded',
  no_session_least_loaded: 'least loaded (no session)', load: 'load', round_robin: 'round robin', fallback: 'fallback'};
const W = 420, H = 150, L = 44, R = 8, T = 8, B = 22;
function esc(s) { return String(s).replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c])); }
function readable(map, k) { return map[k] || String(k).replace(/_/g, ' '); }
function fmt(v, unit) {
  if (unit === '%') return (100 * v).toFixed(0) + '%';
  if (unit === 's') return v >= 1 ? v.toFixed(1) + ' s' : (1000 * v).toFixed(v >= 0.01 ? 0 : 1) + ' ms';
  return Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2).replace(/\\.?0+$/, '');
}
function clock(t) { return new Date(t * 1000).toLocaleTimeString([], {hour12: false}); }
// series: [{label, color, dash, pts: [[t, v|null], ...]}]
function chart(name, title, unit, series, t0, t1, fixedMax) {
  let ymax = fixedMax || 0;
  for (const s of series) for (const p of s.pts) if (p[1] !== null && p[1] > ymax) ymax = p[1];
  if (!(ymax > 0)) ymax = 1;
  if (!fixedMax) ymax *= 1.1;
  const span = Math.max(t1 - t0, 1e-9);
  const x = t => L + (W - L - R) * (t - t0) / span, y = v => T + (H - T - B) * (1 - v / ymax);
  let g = '';
  for (let i = 0; i <= 4; i++) {
    const v = ymax * i / 4, yy = y(v).toFixed(1);
    g += `<line class="gridline" x1="${L}" x2="${W - R}" y1="${yy}" y2="${yy}"/>` +
         `<text x="${L - 4}" y="${(+yy + 3).toFixed(1)}" text-anchor="end">${fmt(v, unit)}</text>`;
  }
  for (let i = 0; i <= 3; i++) {
    const t = t0 + span * i / 3;
    g += `<text x="${x(t).toFixed(1)}" y="${H - 6}" text-anchor="${i === 0 ? 'start' : i === 3 ? 'end' : 'middle'}">${clock(t)}</text>`;
  }
  g += `<line class="axis" x1="${L}" x2="${L}" y1="${T}" y2="${H - B}"/><line class="axis" x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}"/>`;
  for (const s of series) {
    let d = '', pen = false, n = 0;
    for (const [t, v] of s.pts) {
      if (v === null || v === undefined) { pen = false; continue; }
      d += `${pen ? 'L' : 'M'}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true; n++;
    }
    g += `<path class="series" data-series="${esc(s.label)}" data-points="${n}" d="${d}" stroke="${s.color}"` +
         (s.dash ? ' stroke-dasharray="5,3"' : '') + '/>';
  }
  const legend = series.map(s => `<span><span class="sw${s.dash ? ' dash' : ''}" style="border-color:${s.color}"></span>${esc(s.label)}</span>`).join('');
  return `<div class="panel"><h3>${esc(title)}</h3><svg class="chart" data-chart="${esc(name)}" width="${W}" height="${H}" ` +
         `viewBox="0 0 ${W} ${H}" role="img" aria-label="${esc(title)}">${g}</svg><div class="legend">${legend || 'no data yet'}</div></div>`;
}
function replicaSeries(points, rids, key, suffix, dash) {
  return rids.map((rid, i) => ({label: rid + (suffix || ''), color: COLORS[i % COLORS.length], dash: !!dash,
    pts: points.map(p => [p.t, p.replicas[rid] ? p.replicas[rid][key] : null])}));
}
function drawHistory(h) {
  const pts = h.points;
  if (!pts.length) return;
  const t0 = pts[0].t, t1 = pts[pts.length - 1].t;
  const rids = [...new Set(pts.flatMap(p => Object.keys(p.replicas)))].sort();
  const reasons = [...new Set(pts.flatMap(p => Object.keys(p.reasons)))].sort();
  document.getElementById('span').textContent =
    `(last ${Math.round(t1 - t0)} s, one point every ${h.interval_s} s, at most ${h.capacity} points)`;
  let html = chart('hit_ratio', 'Prompt-token hit ratio at the router (cached / prompt tokens of the requests finished per interval)', '%', replicaSeries(pts, rids, 'hit_ratio'), t0, t1, 1);
  html += chart('ttft', 'Time to first token: p50 (solid), p99 (dashed)', 's',
    replicaSeries(pts, rids, 'ttft_p50', ' p50').concat(replicaSeries(pts, rids, 'ttft_p99', ' p99', true)), t0, t1);
  html += chart('requests_per_s', 'Requests routed per second', '', replicaSeries(pts, rids, 'requests_per_s'), t0, t1);
  html += chart('routing_reasons', 'Routing decisions per second, by reason', '', reasons.map((r, i) => ({
    label: readable(REASON_NAMES, r), color: COLORS[i % COLORS.length], dash: false, pts: pts.map(p => [p.t, p.reasons[r] || 0])})), t0, t1);
  document.getElementById('cluster-charts').innerHTML = html;
  let per = '';
  for (const rid of rids) {
    const blockSeries = [['used_blocks', 'used', '#d9534f'], ['cached_blocks', 'cached', '#5bc0de'], ['free_blocks', 'free', '#5cb85c']]
      .map(([k, label, color]) => ({label, color, dash: false, pts: pts.map(p => [p.t, p.replicas[rid] ? p.replicas[rid][k] : null])}));
    const cap = Math.max(0, ...pts.map(p => (p.replicas[rid] && p.replicas[rid].capacity_blocks) || 0));
    per += chart('blocks:' + rid, `KV blocks: ${rid}` + (cap ? ` (capacity ${cap})` : ''), '', blockSeries, t0, t1, cap || undefined);
    const queues = [...new Set(pts.flatMap(p => p.replicas[rid] ? Object.keys(p.replicas[rid].queue_sizes) : []))].sort();
    per += chart('queues:' + rid, `Eviction-queue sizes (blocks): ${rid}`, '', queues.map((q, i) => ({
      label: readable(QUEUE_NAMES, q), color: COLORS[i % COLORS.length], dash: false,
      pts: pts.map(p => [p.t, p.replicas[rid] ? (p.replicas[rid].queue_sizes[q] ?? null) : null])})), t0, t1);
  }
  document.getElementById('replica-charts').innerHTML = per;
}
function bar(c) {
  const cap = c.capacity_blocks || 1;
  const used = 100 * (c.used_blocks || 0) / cap, cached = 100 * (c.cached_blocks || 0) / cap;
  return `<div class="bar" title="used ${c.used_blocks||0}, cached ${c.cached_blocks||0}, free ${c.free_blocks||0}">` +
         `<div class="used" style="width:${used}%"></div><div class="cached" style="width:${cached}%"></div></div>`;
}
function host(h) {
  if (!h) return '-';
  return `${h.used_blocks || 0}/${h.capacity_blocks || 0}, ${((h.hit_ratio || 0) * 100).toFixed(1)}%, ` +
         `${h.promotions || 0}, ${h.demotions || 0}`;
}
function drawState(s) {
  document.getElementById('meta').innerHTML =
    `policy <b>${esc(s.routing_policy)}</b> &middot; redis ` +
    (s.redis_connected ? 'connected' : '<span class="bad">disconnected</span>') +
    ` &middot; ${s.replicas.length} replicas &middot; updated ${new Date().toLocaleTimeString([], {hour12: false})}`;
  document.getElementById('rows').innerHTML = s.replicas.map(x => {
    const c = x.cache || {};
    const q = Object.entries(c.queue_sizes || {}).map(([k, v]) => `${esc(readable(QUEUE_NAMES, k))}: ${v}`).join(', ');
    return `<tr><td>${esc(x.info.replica_id)}</td><td>${esc(x.info.address)}${x.info.hop_address ? `<br><small>hop ${esc(x.info.hop_address)}</small>` : ''}</td><td>${esc(x.info.device)}</td>` +
           `<td class="${x.info.healthy ? '' : 'bad'}">${x.info.healthy ? 'ok' : 'down'}</td>` +
           `<td>${x.running}</td><td>${x.waiting}</td><td>${bar(c)}</td><td>${c.capacity_blocks || 0}</td>` +
           `<td>${((c.hit_ratio || 0) * 100).toFixed(1)}%</td><td>${c.evictions || 0}</td><td>${host(c.host)}</td><td>${x.indexed_blocks}</td>` +
           `<td class="queues">${q}</td></tr>`;
  }).join('');
  document.getElementById('cost-rows').innerHTML = s.replicas.map(x => {
    const k = x.costs || {};
    const ms = v => ((v || 0) * 1e3).toFixed(2);
    return `<tr><td>${esc(x.info.replica_id)}</td><td>${k.fitted ? 'yes' : 'prior'}</td><td>${ms(k.prefill_base_s)}</td>` +
           `<td>${((k.prefill_per_token_s || 0) * 1e6).toFixed(1)}</td><td>${ms(k.per_outstanding_s)}</td>` +
           `<td>${ms(k.decode_base_s)} + ${ms(k.decode_per_seq_s)}</td>` +
           `<td>${ms(k.ttft_abs_error_s)} ms, ${((k.ttft_rel_error || 0) * 100).toFixed(0)}%</td><td>${k.predictions || 0}</td>` +
           `<td class="${(k.overdue_factor || 1) > 1 ? 'bad' : ''}">&times;${(k.overdue_factor || 1).toFixed(2)}</td></tr>`;
  }).join('');
}
async function refresh() {
  try {
    const [s, h] = await Promise.all(['/v1/cluster/state', '/dashboard/history'].map(
      u => fetch(u, {cache: 'no-store'}).then(r => { if (!r.ok) throw new Error(u + ': ' + r.status); return r.json(); })));
    drawState(s);
    drawHistory(h);
  } catch (e) {
    document.getElementById('meta').innerHTML = '<span class="bad">router unreachable: ' + esc(e.message) + '</span>';
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
"""
