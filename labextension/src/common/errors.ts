/**
 * What goes wrong talking to the themisto server: the error the transport throws, and the short
 * sentence the panel's status line shows for it.
 */

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
export function describeFailure(error: unknown): string {
  if (error instanceof ThemistoError) {
    switch (error.status) {
      case 0:
        return `Themisto server unreachable (${error.message}).`;
      case 503:
        return `Backend unavailable: ${error.message}`;
      case 504:
        return `Backend timed out: ${error.message}`;
      case 404:
        return `Prediction unavailable: ${error.message}`;
      default:
        return `Prediction failed (${error.status}): ${error.message}`;
    }
  }
  return `Prediction failed: ${String(error)}`;
}
