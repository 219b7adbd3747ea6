"""The ``cuda`` target (NVIDIA GPUs, sm_90a / sm_100a): TileLang compiles and exports the
kernels as tvm-ffi libraries; ``backend`` says how, and what the archs allow."""
