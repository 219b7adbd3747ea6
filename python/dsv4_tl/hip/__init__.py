"""The ``hip`` target (AMD GPUs, gfx942 / gfx950): what is specific to it beyond TileLang's
HIP lowering. ``resources`` reads built code objects (registers, LDS, spills, MFMA use, occupancy)
without an AMD GPU; CI requires its limits on every HIP build (``tests/builds/test_hip_build.py``).
"""
