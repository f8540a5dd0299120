/**
 * The parts of a suggestion that Alt+→ (a word) and Ctrl+↓ (a line) accept.
 */
import { firstPart } from '../parts';

const SUGGESTION = "df = pd.read_csv('sales.csv')\n    df.head()";

describe('firstPart', () => {
  it('takes a line with its line break, or all of a last line', () => {
    expect(firstPart(SUGGESTION, 'line')).toBe("df = pd.read_csv('sales.csv')\n");
    expect(firstPart('df.head()', 'line')).toBe('df.head()');
    expect(firstPart('\nx = 1', 'line')).toBe('\n');
  });

  it('takes a word, or a run of punctuation, with the blanks before it', () => {
    const parts: string[] = [];
    let rest = SUGGESTION;
    while (rest) {
      const part = firstPart(rest, 'word');
      expect(part.length).toBeGreaterThan(0);
      parts.push(part);
      rest = rest.slice(part.length);
    }
    expect(parts).toEqual([
      'df',
      ' =',
      ' pd',
      '.',
      'read_csv',
      "('",
      'sales',
      '.',
      'csv',
      "')",
      '\n    df',
      '.',
      'head',
      '()'
    ]);
    expect(parts.join('')).toBe(SUGGESTION);
  });

  it('takes trailing blanks whole', () => {
    expect(firstPart('  \n', 'word')).toBe('  \n');
    expect(firstPart('', 'word')).toBe('');
  });
});
