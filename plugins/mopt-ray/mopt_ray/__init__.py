"""mopt's Ray executor: cache misses run as Ray tasks on workers that match their hardware."""

__version__ = "0.1.0"
