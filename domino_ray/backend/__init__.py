"""The CPU backend: our C++ ops (`csrc/`, registered in one file, `csrc/registration.cpp`), their build and load
for this machine (`library.py`), the one Python module that names them (`ops.py`), and glibc's allocator settings
(`malloc.py`). Imports torch and nothing of ours."""
