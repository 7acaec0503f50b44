"""mopt-image: the `image` target kind (reproducible OCI images of the serving stack)."""

__version__ = "0.1.0"
