"""Backbones: loading (aliases, local dirs, Hub ids) and architecture layout tables."""
