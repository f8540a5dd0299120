/**
 * The recorded trajectories and their executions, as the server's store routes list them.
 */
import { requestJSON } from './request';
import { IExecution, ITrajectory } from './types';

/** Trajectories, newest first; only those of a notebook path and/or a kernel, if given. */
export async function listTrajectories(
  query: { notebook_path?: string; kernel_id?: string; limit?: number } = {}
): Promise<ITrajectory[]> {
  const params = new URLSearchParams();
  if (query.notebook_path) {
    params.set('notebook_path', query.notebook_path);
  }
  if (query.kernel_id) {
    params.set('kernel_id', query.kernel_id);
  }
  params.set('limit', String(query.limit ?? 20));
  const reply = await requestJSON<{ trajectories: ITrajectory[] }>(
    `trajectories?${params.toString()}`
  );
  return reply.trajectories ?? [];
}

/** A page of a trajectory's executions in the order they ran, and how many there are in all. */
export async function listExecutions(
  trajectoryId: string,
  offset = 0,
  limit = 500
): Promise<{ executions: IExecution[]; total: number }> {
  return requestJSON(
    `trajectories/${encodeURIComponent(trajectoryId)}/executions?offset=${offset}&limit=${limit}`
  );
}
