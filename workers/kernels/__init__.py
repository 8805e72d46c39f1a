"""Hand-written CPU kernels, compiled at first use (workers/native_build.py), for products torch runs slowly."""
