"""Suite-wide setup.

Triton kernels can only run on this CPU-only machine through Triton's interpreter, and Triton reads
TRITON_INTERPRET when a kernel is decorated, so it is set before anything imports `kernels`.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
