"""The package version (a leaf: the server reports it without importing the package API)."""

__version__ = "0.1.0"
