// What the browser tests read from a JupyterLab page: installed as window.ampvizProbe before the page loads
// (Playwright's add_init_script), called from tests/browser/notebook_page.py and test_lessons.py.
//
// Cells are numbered 0-based in notebook order (markdown included), as in nbformat and the reviews; the
// notebook runs without windowing (conftest.py), so every cell is in the DOM. A "control" is an enabled or
// disabled ipywidgets input in a cell's outputs; its key (cell, kind, description, ordinal) stays the same
// when a widget re-renders, so the test finds it again after every change.
window.ampvizProbe = (() => {
  const panel = () => document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const cells = () => Array.from(panel().querySelectorAll('.jp-Notebook .jp-Cell'));
  const prompt = (cell) => (cell.querySelector('.jp-InputPrompt') || {}).textContent || '';
  const shown = (el) => el.getClientRects().length > 0;
  const ERROR = /Traceback \(most recent call last\)|^\w*(Error|Exception)\b/m;

  // -- running the notebook ------------------------------------------------------------------------
  // 'done' once every code cell has an execution count and none is queued; 'error' when a cell not tagged
  // raises-exception shows a traceback; 'stalled' when nothing is queued or busy for 5 s but some code
  // cell never ran (queued cells dropped by a kernel replaced while the page connected).
  const outcome = (allowed) => {
    const code = cells().map((c, i) => [c, i]).filter(([c]) => c.classList.contains('jp-CodeCell'));
    const failed = code.filter(([c, i]) => !allowed.includes(i) && Array.from(
      c.querySelectorAll(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"))
      .some((e) => ERROR.test(e.textContent)));
    if (failed.length) return {state: 'error', cells: failed.map(([c, i]) => [i, c.querySelector(
      ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").textContent.slice(-1500)])};
    const queued = code.some(([c]) => prompt(c).includes('*'));
    const busy = panel().querySelector(".jp-Notebook-ExecutionIndicator[data-status='busy']");
    if (queued || busy) { window.__ampvizIdleSince = null; return false; }
    window.__ampvizIdleSince = window.__ampvizIdleSince || Date.now();
    const ran = code.every(([c]) => /\[\d+\]/.test(prompt(c)));
    if (ran) return Date.now() - window.__ampvizIdleSince > 1000 ? {state: 'done'} : false;
    return Date.now() - window.__ampvizIdleSince > 5000 ? {state: 'stalled'} : false;
  };

  // Every widget view and plotly graph has rendered (or a widget failed to: 'Error displaying widget').
  const rendered = () => {
    const outputs = Array.from(panel().querySelectorAll('.jp-OutputArea-output'));
    const broken = outputs.filter((o) => /Error displaying widget|Model not found/.test(o.textContent));
    if (broken.length) return {broken: broken.map((o) => o.textContent.slice(0, 200))};
    const pendingWidgets = outputs.filter((o) => o.dataset.mimeType === 'application/vnd.jupyter.widget-view+json'
                                                 && !o.querySelector('.jupyter-widgets, .js-plotly-plot'));
    const pendingGraphs = Array.from(panel().querySelectorAll('.js-plotly-plot'))
                               .filter((g) => !g.querySelector('.main-svg'));
    return pendingWidgets.length + pendingGraphs.length === 0 ? {broken: []} : false;
  };

  // -- what a learner sees: a fingerprint of a cell's outputs ----------------------------------------
  const num = (v, acc) => {
    if (v == null) return acc;
    if (typeof v === 'number') { if (isFinite(v)) { acc.n++; acc.s += v; acc.w += v * acc.n; } return acc; }
    if (typeof v === 'string' || typeof v === 'boolean') {
      const s = String(v); acc.n++; for (let i = 0; i < s.length; i++) acc.w += s.charCodeAt(i) * (acc.n + i);
      return acc;
    }
    if (Array.isArray(v) || ArrayBuffer.isView(v)) { for (const x of v) num(x, acc); return acc; }
    if (typeof v === 'object') { for (const k of Object.keys(v).sort()) { num(k, acc); num(v[k], acc); } }
    return acc;
  };
  const sum = (v) => { const a = num(v, {n: 0, s: 0, w: 0}); return [a.n, Number(a.s.toPrecision(10)),
                                                                     Number(a.w.toPrecision(10))]; };
  const TRACE_KEYS = ['type', 'visible', 'name', 'x', 'y', 'z', 'text', 'base', 'width', 'marker', 'line',
                      'fillcolor', 'orientation', 'header', 'cells', 'values', 'labels'];
  // per graph: every trace's data summarised, the layout's texts and shapes, and the axis ranges drawn
  const figure = (gd) => {
    const full = gd._fullLayout || {};
    const axes = Object.keys(full).filter((k) => /^[xy]axis\d*$/.test(k)).sort()
                       .map((k) => [k, full[k].type, (full[k].range || []).map((r) => String(r))]);
    const layout = gd.layout || {};
    return {traces: (gd.data || []).map((t) => TRACE_KEYS.map((k) => sum(t[k]))),
            title: sum(layout.title), annotations: sum(layout.annotations), shapes: sum(layout.shapes),
            images: sum(layout.images), axes};
  };
  const figures = (root) => Array.from(root.querySelectorAll('.js-plotly-plot')).map(figure);

  // text shown outside graphs and outside the excluded control; the state of every other control
  const textOf = (root, skip) => {
    const parts = [];
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT | NodeFilter.SHOW_ELEMENT, {
      acceptNode: (n) => {
        if (n.nodeType === 1) {
          if (n === skip || n.classList.contains('js-plotly-plot') || n.tagName === 'STYLE'
              || n.tagName === 'SCRIPT') return NodeFilter.FILTER_REJECT;
          return NodeFilter.FILTER_SKIP;
        }
        return n.textContent.trim() && shown(n.parentElement) ? NodeFilter.FILTER_ACCEPT : NodeFilter.FILTER_SKIP;
      }});
    while (walker.nextNode()) parts.push(walker.currentNode.textContent.trim());
    const state = Array.from(root.querySelectorAll(
      'input, select, textarea, button, .noUi-target, .noUi-handle, .widget-readout, img, canvas'))
      .filter((e) => !(skip && skip.contains(e)) && shown(e))
      .map((e) => [e.tagName, e.value, e.checked, e.disabled || e.hasAttribute('disabled'),
                   e.classList.contains('mod-active'),
                   e.getAttribute('aria-valuenow'), e.tagName === 'IMG' ? sum(e.src) : null]);
    return [parts.join('\u241e'), state];
  };

  const outputsOf = (cellIndex) => cells()[cellIndex].querySelector('.jp-OutputArea');
  const controlRoot = (key) => (key ? find(key) : null);
  // the fingerprint of cell `cellIndex`'s outputs (all cells' when null), leaving out the control `key`
  const fingerprint = (cellIndex, key) => {
    const skip = controlRoot(key);
    const roots = cellIndex == null ? cells().map((c) => c.querySelector('.jp-OutputArea')).filter(Boolean)
                                    : [outputsOf(cellIndex)];
    return JSON.stringify(roots.map((r) => [figures(r), textOf(r, skip)]));
  };

  // -- the controls ------------------------------------------------------------------------------------
  const KINDS = [
    ['slider', '.widget-slider'], ['dropdown', '.widget-dropdown'], ['toggle-buttons', '.widget-toggle-buttons'],
    ['toggle-button', 'button.widget-toggle-button'], ['checkbox', '.widget-checkbox'], ['text', '.widget-text'],
    ['textarea', '.widget-textarea'], ['button', 'button.widget-button'], ['radio', '.widget-radio'],
    ['select', '.widget-select'], ['select-multiple', '.widget-select-multiple'], ['play', '.widget-play'],
    ['colorpicker', '.widget-colorpicker'], ['datepicker', '.widget-datepicker'], ['upload', '.widget-upload'],
    ['tab', '.widget-tab-bar'], ['accordion', '.widget-accordion'], ['tagsinput', '.widget-tagsinput'],
  ];
  const labelOf = (el, kind) => {
    const label = Array.from(el.querySelectorAll(':scope > .widget-label, :scope > label.widget-label'))
                       .map((l) => l.textContent.replace('\u200b', '').trim()).filter(Boolean)[0];
    if (label) return label;
    if (kind === 'checkbox') return (el.querySelector('.widget-label-basic') || el).textContent.trim();
    // a toggle button's text may show its state (a bit's "0" / "1"): its tooltip names it
    if (kind === 'toggle-button') return el.getAttribute('title') || '';
    if (kind === 'button') return el.textContent.trim() || el.getAttribute('title') || '';
    return '';
  };
  const disabledOf = (el) => Boolean(el.matches('[disabled]') || el.querySelector(
    'input:disabled, select:disabled, textarea:disabled, button:disabled, .slider[disabled], .noUi-target[disabled]'));
  const scan = () => {
    const found = [];
    cells().forEach((cell, index) => {
      const area = cell.querySelector('.jp-OutputArea');
      if (!area) return;
      const counts = {};
      const seen = new Set();
      for (const [kind, selector] of KINDS) {
        for (const el of area.querySelectorAll(selector)) {
          if (seen.has(el) || !shown(el) || (kind === 'toggle-button' && el.closest('.widget-toggle-buttons'))) continue;
          seen.add(el);
          const description = labelOf(el, kind);
          const id = `${kind}|${description}`;
          counts[id] = (counts[id] || 0) + 1;
          const control = {cell: index, kind, description, ordinal: counts[id] - 1, disabled: disabledOf(el),
                           text: short(el.textContent)};
          if (kind === 'dropdown' || kind === 'select') {
            const s = el.querySelector('select');
            control.options = Array.from(s.options).map((o) => o.value);
            control.value = s.value;
          } else if (kind === 'toggle-buttons') {
            const buttons = Array.from(el.querySelectorAll('button'));
            control.options = buttons.map((b) => b.textContent.trim() || b.getAttribute('title') || b.value);
            control.value = buttons.findIndex((b) => b.classList.contains('mod-active'));
            control.option_disabled = buttons.map((b) => b.disabled);
          } else if (kind === 'slider') {
            const h = el.querySelector('.noUi-handle');
            control.value = h && h.getAttribute('aria-valuenow');
            control.max = h && h.getAttribute('aria-valuemax');
            const readout = el.querySelector('.widget-readout');
            control.readout = readout ? readout.textContent.trim() : null;
            control.readout_editable = Boolean(readout && readout.isContentEditable);
          } else if (kind === 'text' || kind === 'textarea') {
            const input = el.querySelector('input, textarea');
            Object.assign(control, {value: input.value, type: input.type, min: input.getAttribute('min'),
                                    max: input.getAttribute('max'), step: input.getAttribute('step')});
          } else if (kind === 'checkbox' || kind === 'toggle-button') {
            const input = el.querySelector('input');
            control.value = input ? input.checked : el.classList.contains('mod-active');
          }
          if (control.options && !description) control.text = short(control.options.join(' | '));
          control.key = [index, kind, description, control.ordinal];
          found.push(control);
        }
      }
    });
    return found;
  };
  // the control element of a key, tagged so that Playwright can address it as [data-ampviz-control]
  const find = (key) => {
    const [index, kind, description, ordinal] = key;
    const area = cells()[index].querySelector('.jp-OutputArea');
    const selector = KINDS.find(([k]) => k === kind)[1];
    const matches = Array.from(area.querySelectorAll(selector)).filter((el) => shown(el)
      && !(kind === 'toggle-button' && el.closest('.widget-toggle-buttons')) && labelOf(el, kind) === description);
    return matches[ordinal] || null;
  };
  const tag = (key) => {
    document.querySelectorAll('[data-ampviz-control]').forEach((e) => e.removeAttribute('data-ampviz-control'));
    const el = find(key);
    if (el) el.setAttribute('data-ampviz-control', '1');
    return Boolean(el);
  };

  // -- what a learner sees wrong, checked cheaply ------------------------------------------------------
  const short = (s) => { s = s.replace(/\s+/g, ' ').trim(); return s.length > 60 ? s.slice(0, 57) + '...' : s; };
  const ownText = (el) => Array.from(el.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim());
  const textBox = (el) => { const r = document.createRange(); r.selectNodeContents(el); return r.getBoundingClientRect(); };

  // text that its box cuts off (an ellipsis or hidden overflow), and table cells whose text spills over
  const clippedText = (root) => Array.from(root.querySelectorAll('*')).filter((el) => {
    if (el.closest('svg, .js-plotly-plot') || !ownText(el) || !el.clientWidth) return false;
    const cs = getComputedStyle(el);
    const hides = cs.textOverflow === 'ellipsis' || cs.overflowX === 'hidden' || cs.overflowX === 'clip';
    return (hides || el.matches('td, th')) && el.scrollWidth > el.clientWidth + 1;
  }).map((el) => `text does not fit its box: "${short(el.textContent)}" needs ${el.scrollWidth} px, `
                 + `has ${el.clientWidth} px`);

  // HTML tables whose neighbouring cells' texts (nearly) touch ("forward_to_copy"): less than a third of
  // the font size between them, where a space is about that wide
  const jammedTables = (root) => Array.from(root.querySelectorAll('table')).flatMap((table) => {
    if (table.closest('svg')) return [];
    let worst = null;
    for (const row of table.rows) {
      const cellsOfRow = Array.from(row.cells).filter((c) => c.textContent.trim() && shown(c));
      for (let i = 1; i < cellsOfRow.length; i++) {
        const gap = textBox(cellsOfRow[i]).left - textBox(cellsOfRow[i - 1]).right;
        const room = gap / parseFloat(getComputedStyle(cellsOfRow[i]).fontSize);
        if (worst === null || room < worst[0]) worst = [room, gap, cellsOfRow[i - 1].textContent, cellsOfRow[i].textContent];
      }
    }
    return worst && worst[0] < 1 / 3 ? [`table cells run together: "${short(worst[2])}" and "${short(worst[3])}" `
                                        + `${worst[1].toFixed(1)} px apart`] : [];
  });

  // plotly tables cut a cell's text at the column edge (no wrapping inside a word)
  const clippedTableCells = (gd) => Array.from(gd.querySelectorAll('.column-cell')).flatMap((cell) => {
    const rect = cell.querySelector('.cell-rect'), text = cell.querySelector('.cell-text');
    if (!rect || !text || !text.textContent.trim()) return [];
    const r = rect.getBoundingClientRect(), t = text.getBoundingClientRect();
    return t.right > r.right + 1 ? [`plotly table cell cut off: "${short(text.textContent)}" needs `
                                    + `${Math.ceil(t.right - r.left)} px, column has ${Math.floor(r.width)} px`] : [];
  });

  // scatter traces with points outside a fixed axis range (they leave the plot) or markers cut in half at its edge
  const outsideAxes = (gd) => {
    const full = gd._fullLayout, out = [];
    if (!full) return out;
    for (const t of gd._fullData || []) {
      if (t.type !== 'scatter' || t.visible !== true || !t.x || !t.y) continue;
      const xa = full[t.xaxis.replace('x', 'xaxis')], ya = full[t.yaxis.replace('y', 'yaxis')];
      if (!xa || !ya || ![xa, ya].every((a) => a.type === 'linear' || a.type === 'log')) continue;
      const fixed = [xa, ya].map((a) => a.autorange === false);
      if (!fixed[0] && !fixed[1]) continue;
      const size = t.marker && t.marker.size;
      const radius = t.mode && t.mode.includes('markers') && t.cliponaxis !== false
        ? (typeof size === 'number' ? size : Array.from(size || [0]).reduce((a, b) => Math.max(a, b), 0)) / 2 : 0;
      // a vertical tick (line-ns) reaches no further sideways than its stroke, a horizontal one (line-ew) up or down
      const symbol = String((t.marker && t.marker.symbol) || '');
      const radii = [/^line-ns/.test(symbol) ? 0 : radius, /^line-ew/.test(symbol) ? 0 : radius];
      let outside = 0, cut = 0, n = 0;
      for (let i = 0; i < Math.min(t.x.length, t.y.length); i++) {
        const p = [[xa, t.x[i]], [ya, t.y[i]]].map(([a, v]) => a.d2l(v));
        if (!p.every((v) => v !== undefined && isFinite(v))) continue;
        n++;
        let isOut = false, isCut = false;
        [xa, ya].forEach((a, k) => {
          if (!fixed[k]) return;
          const [lo, hi] = a.range.map((r) => a.r2l(r)).sort((u, v) => u - v);
          const tol = (hi - lo) * 0.005;
          if (p[k] < lo - tol || p[k] > hi + tol) { isOut = true; return; }
          const px = (p[k] - lo) / (hi - lo) * a._length;
          if (radii[k] > 1 && (px < radii[k] - 1 || px > a._length - radii[k] + 1)) isCut = true;
        });
        outside += isOut; cut += isCut && !isOut;
      }
      const name = t.name || `trace ${t.index}`;
      // a trace wholly outside is one the figure leaves out of its range (a limit line past a clamped axis), not one
      // that runs off the plot
      if (outside && outside < n) out.push(`"${name}" leaves the plot: ${outside} of ${n} points outside the axis range`);
      if (cut) out.push(`"${name}": ${cut} of ${n} markers cut by the plot's edge`);
    }
    return out;
  };

  const titleOf = (gd) => short(String(((gd.layout || {}).title || {}).text || 'untitled figure'));
  // [cell, problem] for the outputs of cell `cellIndex` (every cell's when null)
  const layoutProblems = (cellIndex) => {
    const indices = cellIndex == null ? cells().map((c, i) => i) : [cellIndex];
    return indices.flatMap((i) => {
      const root = outputsOf(i);
      if (!root) return [];
      const graphs = Array.from(root.querySelectorAll('.js-plotly-plot'));
      return [...clippedText(root), ...jammedTables(root),
              ...graphs.flatMap((gd) => [...clippedTableCells(gd), ...outsideAxes(gd)]
                                          .map((p) => `figure "${titleOf(gd)}": ${p}`))].map((p) => [i, p]);
    });
  };

  // FigureWidget views (not static figures) drawn with no trace at all: their data reached the page after
  // the view drew (plotly sends a FigureWidget's data in an update after opening its comm; anywidget may
  // render the view before it applies that update, and plotly's view never redraws for it)
  const bareFigureWidgets = () => cells().flatMap((c, i) => Array.from(c.querySelectorAll(
    '.jp-OutputArea .js-plotly-plot:not(.jp-RenderedPlotly)')).filter((gd) => !(gd.data || []).length).map(() => i));

  // graphs in cells with controls (explorers) that show nothing: no trace with a finite non-zero value
  const emptyGraphs = (cellIndex) => Array.from(outputsOf(cellIndex).querySelectorAll('.js-plotly-plot'))
    .filter((gd) => (gd.data || []).length && !(gd._fullData || []).some((t) => t.visible !== false && ['x', 'y', 'z', 'values'].some((k) => {
      const v = t[k];
      return v && Array.from(v).some((x) => typeof x === 'number' ? isFinite(x) && x !== 0
                                                                  : (Array.isArray(x) && x.some((y) => y)));
    })))
    .map(titleOf);

  return {cells: () => cells().length, outcome, rendered, fingerprint, figures, scan, tag, layoutProblems,
          emptyGraphs, bareFigureWidgets};
})();
