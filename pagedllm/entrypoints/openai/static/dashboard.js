'use strict';
// The live KV-cache view: applies the server's delta frames to a local copy of the block map,
// the request rows and their block tables, and draws them. The feed is Server-Sent Events read
// with fetch, so the API key can travel in the Authorization header.
(() => {
  const KEY_STORE = 'pagedllm.apiKey';
  const HISTORY_SECONDS = 300;
  const MAX_ROWS = 300;
  const COLOURS = {
    free: [232, 235, 239], cached_idle: [144, 194, 235], in_use: [102, 187, 106],
    copying: [216, 27, 96], selected: [255, 214, 0],
  };
  const $ = (id) => document.getElementById(id);

  const state = {
    numBlocks: 0, blockSize: 0, codes: new Int32Array(0), copying: new Set(),
    tables: new Map(), rows: new Map(), seq: 0, figures: null, history: [], selected: null,
    connected: false, cell: 1, cols: 1,
  };

  // ---- block states ----
  function stateOf(code, blockId) {
    if (state.copying.has(blockId)) return 'copying';
    const refs = code >> 1;
    if (refs === 0) return code & 1 ? 'cached_idle' : 'free';
    return refs === 1 ? 'in_use' : 'shared';
  }
  function colourOf(blockId) {
    if (state.selected !== null && selectedBlocks().has(blockId)) return COLOURS.selected;
    const code = state.codes[blockId];
    const kind = stateOf(code, blockId);
    if (kind !== 'shared') return COLOURS[kind];
    const depth = Math.min((code >> 1) - 2, 6) / 6;   // ref count 2 light ... 8+ dark
    return [Math.round(240 - 110 * depth), Math.round(150 - 95 * depth), Math.round(40 - 25 * depth)];
  }
  function counts() {
    const result = { free: 0, cached_idle: 0, in_use: 0, shared: 0, copying: 0 };
    for (let id = 0; id < state.numBlocks; id++) result[stateOf(state.codes[id], id)]++;
    return result;
  }
  function ownersOf(blockId) {
    const owners = [];
    for (const [requestId, table] of state.tables) if (table.includes(blockId)) owners.push(requestId);
    return owners;
  }
  let selectedCache = null;
  function selectedBlocks() {
    if (selectedCache === null) selectedCache = new Set(state.tables.get(state.selected) || []);
    return selectedCache;
  }

  // ---- the block map canvas ----
  const canvas = $('map');
  const context = canvas.getContext('2d');
  let image = null;
  let dirty = new Set();
  let repaintAll = true;

  function layout() {
    const width = Math.max(200, Math.floor(canvas.parentElement.clientWidth));
    const maxHeight = Math.max(240, Math.floor(window.innerHeight * 0.55));
    const n = Math.max(state.numBlocks, 1);
    state.cell = Math.max(1, Math.min(24, Math.floor(Math.sqrt((width * maxHeight) / n))));
    state.cols = Math.max(1, Math.floor(width / state.cell));
    canvas.width = state.cols * state.cell;
    canvas.height = Math.ceil(n / state.cols) * state.cell;
    canvas.style.height = canvas.height * (canvas.clientWidth / canvas.width || 1) + 'px';
    image = context.createImageData(canvas.width, canvas.height);
    repaintAll = true;
  }
  function paintCell(blockId) {
    const [r, g, b] = colourOf(blockId);
    const cell = state.cell, gap = cell >= 4 ? 1 : 0;
    const x0 = (blockId % state.cols) * cell, y0 = Math.floor(blockId / state.cols) * cell;
    const data = image.data, width = image.width;
    for (let y = y0; y < y0 + cell - gap; y++) {
      let offset = (y * width + x0) * 4;
      for (let x = 0; x < cell - gap; x++, offset += 4) {
        data[offset] = r; data[offset + 1] = g; data[offset + 2] = b; data[offset + 3] = 255;
      }
    }
  }
  function paintMap() {
    if (image === null) return;
    if (repaintAll) {
      for (let id = 0; id < state.numBlocks; id++) paintCell(id);
    } else {
      for (const id of dirty) if (id < state.numBlocks) paintCell(id);
    }
    repaintAll = false;
    dirty = new Set();
    context.putImageData(image, 0, 0);
  }
  function cellRect(blockId) {   // in CSS pixels of the page, for tests and the tooltip
    const scale = canvas.clientWidth / canvas.width;
    const cell = state.cell * scale;
    return { x: (blockId % state.cols) * cell + cell / 2, y: Math.floor(blockId / state.cols) * cell + cell / 2, size: cell };
  }
  function blockAt(event) {
    const box = canvas.getBoundingClientRect();
    const scale = canvas.width / box.width;
    const col = Math.floor(((event.clientX - box.left) * scale) / state.cell);
    const row = Math.floor(((event.clientY - box.top) * scale) / state.cell);
    const id = row * state.cols + col;
    return col >= 0 && col < state.cols && id >= 0 && id < state.numBlocks ? id : null;
  }

  // ---- hover ----
  const tooltip = $('tooltip');
  let hovered = null, hoverTimer = null, detail = null;
  function showTooltip() {
    if (hovered === null) { tooltip.hidden = true; return; }
    const code = state.codes[hovered];
    const owners = ownersOf(hovered);
    const lines = [`block ${hovered}: ${stateOf(code, hovered).replace('_', ' ')}`, `ref count ${code >> 1}`,
                   `owners: ${owners.length ? owners.join(', ') : 'none'}`];
    if (detail !== null && detail.block_id === hovered) {
      lines.push(`prefix-cache hit: ${detail.prefix_hit_for.length ? 'yes, for ' + detail.prefix_hit_for.join(', ') : 'no'}`);
      if (detail.token_ids.length) lines.push(`tokens (${detail.token_ids.length}): ${JSON.stringify(detail.text)}`);
    } else if ((code >> 1) > 0 || (code & 1)) {
      lines.push('tokens: ...');
    }
    tooltip.textContent = lines.join('\n');
    tooltip.hidden = false;
    const rect = cellRect(hovered);
    tooltip.style.left = Math.min(rect.x + 12, canvas.clientWidth - 200) + 'px';
    tooltip.style.top = rect.y + 12 + 'px';
  }
  canvas.addEventListener('mousemove', (event) => {
    const id = blockAt(event);
    if (id === hovered) return;
    hovered = id; detail = null;
    showTooltip();
    clearTimeout(hoverTimer);
    if (id !== null) hoverTimer = setTimeout(() => fetchDetail(id), 120);
  });
  canvas.addEventListener('mouseleave', () => { hovered = null; showTooltip(); });
  async function fetchDetail(id) {
    try {
      const response = await fetch(`/v1/kv_map/blocks/${id}`, { headers: authHeaders() });
      if (response.ok && hovered === id) { detail = await response.json(); showTooltip(); }
    } catch (error) { /* the feed's status badge already says when the server is gone */ }
  }

  // ---- requests ----
  const tbody = document.querySelector('#requests tbody');
  function phaseText(row) {
    if (row.phase === 'prefill') return `prefill ${row.num_computed_tokens}/${row.num_tokens} tokens`;
    if (row.phase === 'decoding') return `decoding, ${row.num_output_tokens} out`;
    return row.phase;
  }
  function siblingsSharing(row) {
    if (!row.group) return [];
    const mine = new Set(state.tables.get(row.request_id) || []);
    const result = [];
    for (const other of state.rows.values()) {
      if (other.request_id === row.request_id || other.group !== row.group) continue;
      const table = state.tables.get(other.request_id) || [];
      const shared = table.filter((id) => mine.has(id)).length;
      if (shared) result.push(`${other.request_id} (${shared})`);
    }
    return result;
  }
  function renderRequests() {
    const rows = [...state.rows.values()];
    $('request-count').textContent = `${rows.length} (running ${state.figures ? state.figures.num_running : 0}, waiting ${state.figures ? state.figures.num_waiting : 0})`;
    tbody.replaceChildren();
    for (const row of rows.slice(0, MAX_ROWS)) {
      const tr = document.createElement('tr');
      tr.dataset.requestId = row.request_id;
      if (row.request_id === state.selected) tr.className = 'selected';
      const table = state.tables.get(row.request_id) || [];
      const hitBlocks = Math.floor(row.num_cached_tokens / state.blockSize);
      const cells = [row.request_id, phaseText(row), `${row.num_computed_tokens}/${row.num_tokens}`,
                     hitBlocks ? `${hitBlocks} blocks` : '', siblingsSharing(row).join(', ')];
      for (const [index, text] of cells.entries()) {
        const td = document.createElement('td');
        td.textContent = text;
        if (index === 1) td.className = 'phase-' + row.phase;
        tr.appendChild(td);
      }
      const td = document.createElement('td');
      td.appendChild(tableCanvas(table));
      td.title = table.length ? `blocks ${table.join(', ')}` : 'no blocks';
      tr.appendChild(td);
      tr.addEventListener('click', () => select(row.request_id));
      tbody.appendChild(tr);
    }
  }
  function tableCanvas(table) {   // the block table as a row of references into the map
    const mini = document.createElement('canvas');
    const shown = Math.min(table.length, 128);
    mini.width = Math.max(1, shown * 5); mini.height = 10;
    mini.style.width = mini.width + 'px';
    const ctx = mini.getContext('2d');
    for (let i = 0; i < shown; i++) {
      const [r, g, b] = colourOf(table[i]);
      ctx.fillStyle = `rgb(${r},${g},${b})`;
      ctx.fillRect(i * 5, 0, 4, 10);
    }
    return mini;
  }
  function select(requestId) {
    const old = selectedBlocks();
    state.selected = state.selected === requestId ? null : requestId;
    selectedCache = null;
    for (const id of old) dirty.add(id);
    for (const id of selectedBlocks()) dirty.add(id);
    scheduleRender(true);
  }

  // ---- plots ----
  const PLOTS = [
    { title: 'KV usage %', series: [['usage', '#2e7d32']], max: 100 },
    { title: 'running / waiting', series: [['running', '#1565c0'], ['waiting', '#b26a00']] },
    { title: 'step ms: scheduling / model', series: [['scheduling_ms', '#8e24aa'], ['model_ms', '#00838f']] },
    { title: 'tokens per step', series: [['tokens_per_step', '#37474f']] },
    { title: 'prefix-cache hit rate %', series: [['hit_rate', '#1e88e5']], max: 100 },
    { title: 'preemptions per frame', series: [['preemptions', '#c62828']] },
  ];
  const plotCanvases = PLOTS.map((plot) => {
    const box = document.createElement('div');
    box.className = 'plot';
    const title = document.createElement('h3');
    title.textContent = plot.title;
    const plotCanvas = document.createElement('canvas');
    box.append(title, plotCanvas);
    $('plots').appendChild(box);
    return plotCanvas;
  });
  function recordHistory(frame) {
    const figures = frame.figures, steps = frame.steps, last = state.history[state.history.length - 1];
    const point = { time: frame.time, usage: 100 * figures.kv_cache_usage, running: figures.num_running,
                    waiting: figures.num_waiting, queries: figures.prefix_cache_queries, hits: figures.prefix_cache_hits,
                    preemptions: steps ? steps.num_preemptions : 0 };
    if (steps && steps.num_steps) {
      point.scheduling_ms = (1000 * steps.scheduling_seconds) / steps.num_steps;
      point.model_ms = (1000 * (steps.model_seconds + steps.prepare_seconds)) / steps.num_steps;
      point.tokens_per_step = steps.num_tokens / steps.num_steps;
    }
    const queries = last ? point.queries - last.queries : point.queries;
    point.hit_rate = queries > 0 ? (100 * (point.hits - (last ? last.hits : 0))) / queries : (last ? last.hit_rate : 0);
    if (last && point.time < last.time) state.history = [];   // a restarted server
    state.history.push(point);
    while (state.history.length && state.history[0].time < point.time - HISTORY_SECONDS) state.history.shift();
  }
  function drawPlots() {
    const history = state.history;
    if (!history.length) return;
    const end = history[history.length - 1].time, start = end - HISTORY_SECONDS;
    PLOTS.forEach((plot, index) => {
      const plotCanvas = plotCanvases[index];
      const width = (plotCanvas.width = plotCanvas.clientWidth || 200), height = (plotCanvas.height = 90);
      const ctx = plotCanvas.getContext('2d');
      let max = plot.max || 0;
      if (!plot.max) for (const point of history) for (const [key] of plot.series) max = Math.max(max, point[key] || 0);
      max = max || 1;
      ctx.strokeStyle = '#d6dbe1'; ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
      ctx.fillStyle = '#5f6b7a'; ctx.font = '10px sans-serif';
      ctx.fillText(max.toPrecision(3), 3, 10);
      for (const [key, colour] of plot.series) {
        ctx.strokeStyle = colour; ctx.lineWidth = 1.5; ctx.beginPath();
        let started = false;
        for (const point of history) {
          if (point[key] === undefined) continue;
          const x = ((point.time - start) / HISTORY_SECONDS) * width, y = height - 2 - (point[key] / max) * (height - 14);
          if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
        }
        ctx.stroke();
        const lastPoint = [...history].reverse().find((point) => point[key] !== undefined);
        if (lastPoint) ctx.fillText(`${key.replace('_', ' ')} ${lastPoint[key].toFixed(1)}`, width - 130, 10 + 11 * plot.series.findIndex(([k]) => k === key));
      }
    });
  }

  // ---- frames ----
  function applyFrame(frame) {
    if (frame.full) {
      state.numBlocks = frame.blocks.length;
      state.blockSize = frame.block_size;
      state.codes = Int32Array.from(frame.blocks);
      state.tables = new Map();
      state.rows = new Map();
      state.copying = new Set();
      layout();
    } else {
      if (frame.seq !== state.seq + 1) throw new Error(`frame ${frame.seq} after ${state.seq}: a delta is missing`);
      for (const id of state.copying) dirty.add(id);
      state.copying = new Set();
      const blocks = frame.blocks;
      for (let i = 0; i < blocks.length; i += 2) { state.codes[blocks[i]] = blocks[i + 1]; dirty.add(blocks[i]); }
    }
    for (const [requestId, [start, ids]] of Object.entries(frame.tables)) {
      const table = (state.tables.get(requestId) || []).slice(0, start).concat(ids);
      state.tables.set(requestId, table);
    }
    for (const requestId of frame.removed_tables) state.tables.delete(requestId);
    for (const row of frame.requests) state.rows.set(row.request_id, row);
    for (const requestId of frame.removed_requests) { state.rows.delete(requestId); state.tables.delete(requestId); }
    if (frame.steps) for (const [source, destination] of frame.steps.block_copies) {
      state.copying.add(source); state.copying.add(destination); dirty.add(source); dirty.add(destination);
    }
    if (state.selected !== null) { for (const id of selectedBlocks()) dirty.add(id); selectedCache = null; for (const id of selectedBlocks()) dirty.add(id); }
    state.seq = frame.seq;
    state.figures = frame.figures;
    recordHistory(frame);
    scheduleRender(frame.full);
  }
  // Blocks below the pool (disk tier, swapped-out requests) are counts beside the map, not cells in it.
  function renderTiers(f) {
    $('tier-disk').hidden = f.num_disk_blocks === undefined;
    if (f.num_disk_blocks !== undefined) {
      $('count-on_disk').textContent = f.num_disk_blocks;
      $('disk-capacity').textContent = f.disk_capacity_blocks;
    }
    $('tier-swapped').hidden = f.num_swapped_blocks === undefined;
    if (f.num_swapped_blocks !== undefined) {
      $('count-swapped').textContent = f.num_swapped_blocks;
      $('swap-tier').textContent = f.swap_tier;
    }
  }
  let renderPending = false, lastSlowRender = 0;
  function scheduleRender(all) {
    if (all) lastSlowRender = 0;
    if (renderPending) return;
    renderPending = true;
    requestAnimationFrame(() => {
      renderPending = false;
      paintMap();
      const now = performance.now();
      const c = counts();
      for (const [kind, value] of Object.entries(c)) $('count-' + kind).textContent = value;
      $('cell-count').textContent = `${state.numBlocks} blocks of ${state.blockSize} tokens`;
      const f = state.figures;
      if (f) {
        $('summary').textContent = `KV usage ${(100 * f.kv_cache_usage).toFixed(1)}% · running ${f.num_running} · waiting ${f.num_waiting} · preemptions ${f.num_preemptions}`;
        renderTiers(f);
      }
      if (now - lastSlowRender > 500) { lastSlowRender = now; renderRequests(); drawPlots(); }
      if (hovered !== null) showTooltip();
    });
  }

  // ---- the feed ----
  function authHeaders() {
    const key = sessionStorage.getItem(KEY_STORE);
    return key ? { Authorization: `Bearer ${key}` } : {};
  }
  function setStatus(kind, text) {
    const badge = $('status');
    badge.className = 'status ' + kind;
    badge.textContent = text;
    state.connected = kind === 'live';
  }
  function askForKey(message) {
    $('key-form').hidden = false;
    $('key-error').textContent = message;
    setStatus('disconnected', 'needs API key');
  }
  $('key-form').addEventListener('submit', (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $('key-input').value);
    $('key-form').hidden = true;
    connect();
  });
  let retryDelay = 1000;
  async function connect() {
    setStatus('connecting', 'connecting');
    try {
      const response = await fetch('/v1/kv_map/events', { headers: authHeaders(), cache: 'no-store' });
      if (response.status === 401) {
        askForKey(sessionStorage.getItem(KEY_STORE) ? 'that key was refused' : '');
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf('\n\n')) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = event.split('\n').filter((line) => line.startsWith('data: ')).map((line) => line.slice(6)).join('\n');
          if (!data) continue;
          applyFrame(JSON.parse(data));
          if (!state.connected) { setStatus('live', 'live'); retryDelay = 1000; }
        }
      }
      throw new Error('the server ended the feed');
    } catch (error) {
      setStatus('disconnected', `disconnected, retrying in ${Math.round(retryDelay / 1000)} s`);
      setTimeout(connect, retryDelay);
      retryDelay = Math.min(retryDelay * 2, 10000);
    }
  }
  window.addEventListener('resize', () => { layout(); scheduleRender(true); });
  window.kvDashboard = { state, counts, cellRect, ownersOf, stateOf };
  if (document.body.dataset.apiKeyRequired === 'true' && !sessionStorage.getItem(KEY_STORE)) askForKey('');
  else connect();
})();
