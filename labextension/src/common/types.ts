/**
 * Message types crossing the wire between the plugin and the themisto server routes.
 */

/**
 * What a prediction is of, and the route that answers it (/themisto/predict/<task>): the
 * server's `Task` (jupyter_themisto/backends/base.py).
 */
export type Task = 'next-cell' | 'output';

/** A recorded trajectory (the store's dict). */
export interface ITrajectory {
  id: string;
  notebook_path: string | null;
  kernel_id: string | null;
  started_at: number | string | null;
  n_executions?: number;
  [key: string]: unknown;
}

/** One recorded execution (a store row). */
export interface IExecution {
  id: string | number;
  order_index: number;
  cell_id: string | null;
  execution_count: number | null;
  source: string;
  outputs: unknown[];
  status: string;
  started_at: number | string | null;
  wall_time: number | null;
  cpu_time: number | null;
  memory_before: number | null;
  memory_after: number | null;
  memory_peak: number | null;
  snapshot_status: string | null;
}

/** A cell of the notebook as the prediction request carries it. */
export interface INotebookCell {
  cell_type: string;
  source: string;
  id?: string;
}

/** Body of POST /themisto/predict/next-cell and /themisto/predict/output. */
export interface IPredictRequest {
  kernel_id?: string;
  /** The kernel's execution count of the cell the prediction follows: the server answers once
   * that execution is recorded. */
  after_execution_count?: number;
  trajectory_id?: string;
  notebook_path?: string;
  backend?: string;
  with_runtime?: boolean;
  n?: number;
  cells?: INotebookCell[];
  cells_below?: INotebookCell[];
  source?: string;
  client_id?: string;
  /** Next cell only: just let the backend prepare (answered 204, nothing streamed). */
  warm?: boolean;
  /** With `warm`: a local model also writes the suggestion ahead, for the early answer. */
  ahead?: boolean;
  /** Only stop what a local model writes ahead (the typing went on after a warm-up with `ahead`). */
  stop_ahead?: boolean;
}

export interface IMetaEvent {
  backend: string;
}

export interface INextCellChunk {
  index: number;
  text: string;
  done: boolean;
  score?: number | null;
  /** The text replaces what came for this suggestion so far (an early answer gives way). */
  replace?: boolean;
}

export interface IOutputChunk {
  text: string;
  metadata?: IChunkMetadata;
}

/** What a backend says about its answer, e.g. what stopped a preview and who stood in. */
export interface IChunkMetadata {
  preview?: {
    stopped?: string[];
    status?: string;
    fallback?: string;
    sandbox?: Record<string, string>;
    /** The preview's CPU seconds, when that bound stopped it. */
    cpu_bound?: number;
  };
}

/** Why a backend has nothing: the server's reason (English), and for some reasons a code and
 * details that the frontend words in the person's language. */
export interface INoPredictionEvent {
  reason: string;
  code?: string;
  details?: Record<string, unknown>;
}

export interface IDoneEvent {
  backend: string;
  elapsed_ms: number;
}

/** One server-sent event, already JSON-decoded. */
export type PredictEvent =
  | { event: 'meta'; data: IMetaEvent }
  | { event: 'chunk'; data: INextCellChunk & IOutputChunk }
  | { event: 'no_prediction'; data: INoPredictionEvent }
  | { event: 'error'; data: { status: number; message: string } }
  | { event: 'done'; data: IDoneEvent };

/** A next-cell suggestion as it accumulates from the stream. */
export interface ISuggestion {
  index: number;
  text: string;
  done: boolean;
  score: number | null;
}

/** The outcome of a whole prediction request. */
export interface IPredictionResult {
  backend: string | null;
  elapsedMs: number | null;
  suggestions: ISuggestion[];
  output: string;
  noPrediction: string | null;
  /** The no_prediction event as sent (its code and details; see `noPredictionText`). */
  noPredictionEvent: INoPredictionEvent | null;
  /** What stopped a preview when another backend stood in for it (see `standInNote`). */
  standIn: IChunkMetadata['preview'] | null;
}
