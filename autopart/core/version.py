"""The autopart version, recorded in plans and profile caches."""

__all__ = ["__version__"]

__version__ = "0.1.0"
