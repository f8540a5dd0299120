// ESLint for the plugin's TypeScript (sources and unit tests) and its settings schema: the
// recommended JS and TypeScript rules, Jupyter's extension rules, and prettier's formatting.
import js from '@eslint/js';
import jupyter from '@jupyter/eslint-plugin';
import prettierRecommended from 'eslint-plugin-prettier/recommended';
import { defineConfig } from 'eslint/config';
import globals from 'globals';
import tseslint from 'typescript-eslint';

export default defineConfig([
  { ignores: ['node_modules', 'lib', 'coverage', '**/*.js', '**/*.mjs', '**/*.d.ts'] },
  { files: ['**/*.ts'], extends: [js.configs.recommended, tseslint.configs.recommended] },
  { plugins: { jupyter } },
  jupyter.configs.recommended,
  {
    files: ['**/*.ts'],
    languageOptions: {
      globals: globals.browser,
      // tsconfig.test.json covers the sources and the tests alike.
      parserOptions: { project: './tsconfig.test.json', tsconfigRootDir: import.meta.dirname }
    },
    rules: {
      '@typescript-eslint/naming-convention': [
        'error',
        { selector: 'interface', format: ['PascalCase'], custom: { regex: '^I[A-Z]', match: true } }
      ],
      // A class's options live in a namespace of its name (`Widget.IOptions`): JupyterLab's and
      // Lumino's own idiom, kept as the extension template does.
      '@typescript-eslint/no-namespace': 'off',
      '@typescript-eslint/no-unused-vars': ['error', { args: 'none' }],
      curly: ['error', 'all'],
      eqeqeq: 'error',
      'prefer-arrow-callback': 'error'
    }
  },
  {
    // The plugin's activate() sets up every feature at once (the inline completion provider, the
    // sidebar panel, the commands, the service they share): nothing there can wait for a click.
    files: ['src/index.ts'],
    rules: {
      'jupyter/prefer-lazy-imports': ['warn', { ignoreImports: ['./common/service', './*/plugin'] }]
    }
  },
  {
    files: ['src/**/__tests__/**/*.ts'],
    languageOptions: { globals: { ...globals.node, ...globals.jest } }
  },
  { files: ['**/*.ts'], extends: [prettierRecommended] }
]);
