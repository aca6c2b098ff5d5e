"""toolledger's version, in one module that imports nothing: the package, ``--version``, the
audit API's document and the tracer's name read it here."""

__version__ = "0.1.0"
