"""Support for the browser tests: a real `jupyter lab` subprocess and Playwright."""
