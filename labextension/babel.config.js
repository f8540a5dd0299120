// Babel turns the ES modules some dependencies ship into CommonJS for jest (see jest.config.js).
module.exports = require('@jupyterlab/testing/lib/babel-config');
