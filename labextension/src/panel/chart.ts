/**
 * A small plain-SVG chart of wall time (bars) and memory (line) across a trajectory.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { IExecution } from '../common/types';

const SVG = 'http://www.w3.org/2000/svg';

function el(name: string, attrs: Record<string, string | number>): SVGElement {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) {
    node.setAttribute(key, String(value));
  }
  return node;
}

/** How an execution is numbered, as the notebook numbers it: In [n] (from 1 without one). */
export function executionNumber(execution: IExecution): string {
  return String(execution.execution_count ?? execution.order_index + 1);
}

export function formatSeconds(seconds: number | null): string {
  if (seconds === null || seconds === undefined) {
    return '–';
  }
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
}

export function formatBytes(bytes: number | null): string {
  if (bytes === null || bytes === undefined) {
    return '–';
  }
  return `${(bytes / (1024 * 1024)).toFixed(1)} MB`;
}

/** The memory an execution left (its peak where the memory after it was not measured). */
function memoryOf(execution: IExecution): number | null {
  return execution.memory_after ?? execution.memory_peak ?? null;
}

/**
 * What the chart draws, in words: the longest wall time (the bars' scale) and the range of
 * memory (the line spans it from bottom to top, however small it is).
 */
export function chartLegend(executions: IExecution[], trans: TranslationBundle): string {
  const times = executions.map(e => e.wall_time).filter((t): t is number => t !== null);
  const mems = executions.map(memoryOf).filter((m): m is number => m !== null);
  const parts = [
    trans.__('Bars: wall time, longest %1', formatSeconds(times.length ? Math.max(...times) : null))
  ];
  if (mems.length) {
    const low = formatBytes(Math.min(...mems));
    const high = formatBytes(Math.max(...mems));
    parts.push(
      low === high
        ? trans.__('Line: memory, %1', low)
        : trans.__('Line: memory, %1 to %2', low, high)
    );
  }
  return parts.join(' · ');
}

export function renderChart(
  executions: IExecution[],
  trans: TranslationBundle,
  width = 260,
  height = 90
): SVGElement {
  const svg = el('svg', {
    class: 'jp-ThemistoChart',
    width: '100%',
    height,
    viewBox: `0 0 ${width} ${height}`,
    preserveAspectRatio: 'none',
    role: 'img'
  });
  const title = el('title', {});
  title.textContent = trans.__('Wall time (bars) and memory after each execution (line)');
  svg.appendChild(title);
  if (!executions.length) {
    return svg;
  }
  const pad = 4;
  const plotH = height - 2 * pad;
  const step = (width - 2 * pad) / executions.length;
  const maxTime = Math.max(...executions.map(e => e.wall_time ?? 0), 1e-6);
  const mems = executions.map(memoryOf);
  const known = mems.filter((m): m is number => m !== null);
  const minMem = known.length ? Math.min(...known) : 0;
  const maxMem = known.length ? Math.max(...known) : 1;
  executions.forEach((execution, i) => {
    const h = ((execution.wall_time ?? 0) / maxTime) * plotH;
    const bar = el('rect', {
      class: `jp-ThemistoChart-bar jp-mod-${execution.status}`,
      x: pad + i * step + step * 0.15,
      y: height - pad - h,
      width: Math.max(step * 0.7, 1),
      height: Math.max(h, 1)
    });
    const tip = el('title', {});
    tip.textContent = `#${executionNumber(execution)}: ${formatSeconds(execution.wall_time)}, ${formatBytes(mems[i])}`;
    bar.appendChild(tip);
    svg.appendChild(bar);
  });
  const points: string[] = [];
  mems.forEach((mem, i) => {
    if (mem === null) {
      return;
    }
    const span = maxMem - minMem || 1;
    const y = height - pad - ((mem - minMem) / span) * plotH * 0.9 - plotH * 0.05;
    points.push(`${(pad + (i + 0.5) * step).toFixed(1)},${y.toFixed(1)}`);
  });
  if (points.length) {
    svg.appendChild(el('polyline', { class: 'jp-ThemistoChart-memory', points: points.join(' ') }));
  }
  return svg;
}
