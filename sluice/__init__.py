"""Composition root: settings, CLI and the wiring of embedded and distributed modes."""

__version__ = "0.1.0"
