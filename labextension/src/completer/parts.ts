/**
 * Parts of a suggestion accepted one at a time (jupyterlab#15531 asks for it): a word or a line.
 */

/** Up to the end of the next word (`word`) or of the line, its line break included (`line`). */
export type Part = 'word' | 'line';

/** The first `part` of `rest` (the suggestion's text after what the cell holds already). */
export function firstPart(rest: string, part: Part): string {
  if (part === 'line') {
    const end = rest.indexOf('\n');
    return end < 0 ? rest : rest.slice(0, end + 1);
  }
  // Blanks and line breaks before it, then a run of word characters or of other characters.
  const word = /^\s*(?:\w+|[^\w\s]+)/.exec(rest);
  return word ? word[0] : rest;
}
