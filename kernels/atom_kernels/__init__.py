"""Triton kernels for the ATOM runtime, each beside a plain torch reference."""
