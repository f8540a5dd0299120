/**
 * The chart's legend: what the bars and the line stand for, with the scale each is drawn to.
 */
import { nullTranslator } from '@jupyterlab/translation';

import { IExecution } from '../../common/types';
import { chartLegend, executionNumber } from '../chart';

const MB = 1024 * 1024;

function execution(
  wall_time: number | null,
  memory_after: number | null,
  memory_peak: number | null = null
): IExecution {
  return {
    id: 1,
    order_index: 0,
    cell_id: null,
    execution_count: 1,
    source: 'x = 1',
    outputs: [],
    status: 'ok',
    started_at: null,
    wall_time,
    cpu_time: null,
    memory_before: null,
    memory_after,
    memory_peak,
    snapshot_status: null
  };
}

describe('chartLegend', () => {
  const trans = nullTranslator.load('jupyter_themisto');

  it('names the longest wall time and the range of memory the line spans', () => {
    const executions = [
      execution(0.004, 56.7 * MB),
      execution(1.5, 80 * MB),
      execution(0.2, 60 * MB)
    ];
    expect(chartLegend(executions, trans)).toBe(
      'Bars: wall time, longest 1.50 s · Line: memory, 56.7 MB to 80.0 MB'
    );
  });

  it('gives one memory figure when it did not change, and leaves out memory never measured', () => {
    expect(chartLegend([execution(0.001, 10 * MB), execution(0.002, null, 10 * MB)], trans)).toBe(
      'Bars: wall time, longest 2 ms · Line: memory, 10.0 MB'
    );
    expect(chartLegend([execution(null, null)], trans)).toBe('Bars: wall time, longest –');
  });
});

describe('executionNumber', () => {
  it('numbers an execution as the notebook does, In [n], and from 1 without a count', () => {
    expect(executionNumber({ ...execution(0.1, null), order_index: 4, execution_count: 7 })).toBe(
      '7'
    );
    expect(
      executionNumber({ ...execution(0.1, null), order_index: 4, execution_count: null })
    ).toBe('5');
  });
});
