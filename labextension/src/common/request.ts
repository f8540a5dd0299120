/**
 * Requests to the themisto server routes (under /themisto/): the one place that turns a network
 * failure or an error status into a ThemistoError, and JSON requests on top of it.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { responseError, ThemistoError } from './errors';

/**
 * Send a request to `/themisto/<path>` and return the response if it succeeded. A network
 * failure is a ThemistoError of status 0, except when `init.signal` aborted it: then the abort
 * error goes through as it is.
 */
export async function sendRequest(
  path: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<Response> {
  const url = URLExt.join(settings.baseUrl, 'themisto', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    if (init.signal?.aborted) {
      throw error;
    }
    throw new ThemistoError(`server unreachable: ${String(error)}`, 0);
  }
  if (!response.ok) {
    throw await responseError(response);
  }
  return response;
}

/** Send a request to `/themisto/<path>` and decode its JSON answer (`{}` for an empty one). */
export async function requestJSON<T>(
  path: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const text = await (await sendRequest(path, init, settings)).text();
  return (text ? JSON.parse(text) : {}) as T;
}
