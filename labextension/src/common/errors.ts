/**
 * What goes wrong talking to the themisto server: the error the transport throws, and the short
 * sentence the panel's status line shows for it.
 */
import { TranslationBundle } from '@jupyterlab/translation';

/** An HTTP or stream failure, with the status the server gave (0: the network). */
export class ThemistoError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

/** The error a failed response stands for: the server's JSON `message`, else its status line. */
export async function responseError(response: Response): Promise<ThemistoError> {
  const body = await response.text();
  let message = `${response.status} ${response.statusText}`.trim();
  try {
    const parsed = JSON.parse(body);
    if (parsed && typeof parsed.message === 'string' && parsed.message) {
      message = parsed.message;
    }
  } catch {
    // not JSON: the status line says it
  }
  return new ThemistoError(message, response.status);
}

/** A short human sentence for a failure, for the panel's quiet status line. */
export function describeFailure(error: unknown, trans: TranslationBundle): string {
  if (error instanceof ThemistoError) {
    switch (error.status) {
      case 0:
        return trans.__('Themisto server unreachable (%1).', error.message);
      case 503:
        return trans.__('Backend unavailable: %1', error.message);
      case 504:
        return trans.__('Backend timed out: %1', error.message);
      case 404:
        return trans.__('Prediction unavailable: %1', error.message);
      default:
        return trans.__('Prediction failed (%1): %2', error.status, error.message);
    }
  }
  return trans.__('Prediction failed: %1', String(error));
}
