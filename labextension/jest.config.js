// Jest for the plugin's unit tests (src/**/__tests__/*.spec.ts), on JupyterLab's preset: ts-jest
// for TypeScript, babel for the ES modules some dependencies ship.
const jestJupyterLab = require('@jupyterlab/testing/lib/jest-config');

const base = jestJupyterLab(__dirname);

// As the extension template does: JupyterLab's packages that ship ES modules (translation) are
// compiled too, beside the preset's list.
const esModules = ['@codemirror', '@jupyter/ydoc', '@jupyterlab/', 'lib0', 'nanoid', 'yjs'].join(
  '|'
);

module.exports = {
  ...base,
  // The transport runs on Node's own fetch, streams and sockets, as the browser's would; the
  // preset's jsdom environment (and its DOM shims) would replace them with stand-ins.
  testEnvironment: 'node',
  setupFiles: [],
  reporters: ['default'],
  testRegex: 'src/.*/__tests__/.*\\.spec\\.ts$',
  transformIgnorePatterns: [`/node_modules/(?!${esModules}).+`],
  collectCoverageFrom: ['src/**/*.ts', '!src/**/__tests__/**']
};
