"""The package version, read by hatch and by the running code."""

__version__ = "0.1.0"
