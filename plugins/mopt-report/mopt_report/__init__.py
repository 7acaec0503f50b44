"""mopt-report: the `mopt report` command (one HTML page over a recipe's built artifacts)."""

__version__ = "0.1.0"
