"""tracejoin: per-request kernel and GPU measurements joined to the caller's W3C trace."""

__version__ = "0.1.0"
