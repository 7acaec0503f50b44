"""mopt-deploy: from a checked serving artifact to a deployment bundle (kind `deploy`)."""

__version__ = "0.1.0"
