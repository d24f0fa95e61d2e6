"""The ``/dashboard`` page: one static HTML document that polls ``/v1/cluster/state``
every 2 s and draws each replica's cache state (capacity, used/cached/free blocks, hit
ratio, eviction-queue sizes, load, indexed blocks). No external assets (works offline).
"""

DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>UniCache cluster</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.3em; margin-bottom: 0.2em; }
 #meta { color: #666; margin-bottom: 1em; }
 table { border-collapse: collapse; width: 100%; }
 th, td { border-bottom: 1px solid #ddd; padding: 0.35em 0.6em; text-align: right; }
 th:first-child, td:first-child { text-align: left; }
 .bar { display: flex; height: 0.9em; width: 14em; background: #eee; }
 .used { background: #d9534f; } .cached { background: #5bc0de; }
 .bad { color: #c00; font-weight: bold; }
 .queues { font-size: 0.85em; color: #444; text-align: left; }
</style>
</head>
<body>
<h1>UniCache cluster</h1>
<div id="meta">loading&hellip;</div>
<table>
 <thead><tr><th>replica</th><th>address</th><th>device</th><th>health</th><th>running</th><th>waiting</th>
 <th>blocks (used | cached | free)</th><th>capacity</th><th>hit ratio</th><th>evictions</th><th>indexed</th>
 <th>eviction queues</th></tr></thead>
 <tbody id="rows"></tbody>
</table>
<script>
const REFRESH_MS = 2000;
function esc(s) { return String(s).replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c])); }
function bar(c) {
  const cap = c.capacity_blocks || 1;
  const used = 100 * (c.used_blocks || 0) / cap, cached = 100 * (c.cached_blocks || 0) / cap;
  return `<div class="bar" title="used ${c.used_blocks||0}, cached ${c.cached_blocks||0}, free ${c.free_blocks||0}">` +
         `<div class="used" style="width:${used}%"></div><div class="cached" style="width:${cached}%"></div></div>`;
}
async function refresh() {
  try {
    const r = await fetch('/v1/cluster/state', {cache: 'no-store'});
    const s = await r.json();
    document.getElementById('meta').innerHTML =
      `policy <b>${esc(s.routing_policy)}</b> &middot; redis ` +
      (s.redis_connected ? 'connected' : '<span class="bad">disconnected</span>') +
      ` &middot; ${s.replicas.length} replicas &middot; updated ${new Date().toLocaleTimeString()}`;
    document.getElementById('rows').innerHTML = s.replicas.map(x => {
      const c = x.cache || {};
      const q = Object.entries(c.queue_sizes || {}).map(([k, v]) => `${esc(k)}: ${v}`).join(', ');
      return `<tr><td>${esc(x.info.replica_id)}</td><td>${esc(x.info.address)}</td><td>${esc(x.info.device)}</td>` +
             `<td class="${x.info.healthy ? '' : 'bad'}">${x.info.healthy ? 'ok' : 'down'}</td>` +
             `<td>${x.running}</td><td>${x.waiting}</td><td>${bar(c)}</td><td>${c.capacity_blocks || 0}</td>` +
             `<td>${((c.hit_ratio || 0) * 100).toFixed(1)}%</td><td>${c.evictions || 0}</td><td>${x.indexed_blocks}</td>` +
             `<td class="queues">${q}</td></tr>`;
    }).join('');
  } catch (e) {
    document.getElementById('meta').innerHTML = '<span class="bad">router unreachable</span>';
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
"""
