"""The engine: requests, scheduling and admission, the step over fixed-address buffers, CUDA graphs, the memory
plan, and the loop thread the Ray edges drive. Imports sample, spec_decode and below; no Ray, YAML config or HTTP."""
