"""ATOM runtime: the inference engine, its server and model code."""

__version__ = "0.1.0"
