"""The package version, in a module of its own so that every room can read it without importing `remat`."""

__version__ = "0.1.0"
