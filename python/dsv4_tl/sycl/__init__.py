"""The ``sycl`` target: TileLang kernel definitions as SYCL programs.

``lower`` (TileLang's generic SIMT pipeline) and ``codegen`` (SYCL C++ printer) need only
TileLang; ``jit`` compiles the source to SPIR-V with Intel's sycl-jit; ``runtime`` loads
SPIR-V with dpctl and launches it over USM memory. Set up with ``scripts/setup_sycl.sh``.
Verified on Intel's SYCL (OpenCL) CPU device; execution on Intel GPUs is unverified.
"""
