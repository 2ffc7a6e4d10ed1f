"""The backend: our C++ CPU ops (`csrc/`, registered in one file, `csrc/registration.cpp`), their build and load
for this machine (`library.py`), the one Python module that names them (`ops.py`), and glibc's allocator settings
(`malloc.py`); and the CUDA paged attention, a Triton kernel (`paged_triton.py`, triton imported on first use). Imports
torch and nothing of ours."""
