"""Servers that run inside the images (not imported by mopt: they need the image's packages)."""
