"""The package's version, in a module of its own: the parts that report it (telemetry, the
command line) read it here, without importing the package they are part of."""

__version__ = "0.1.0"
