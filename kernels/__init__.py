"""The kernels: leaves that import torch, triton and each other only.

Torch-free modules (`cpu_features`, `kv_formats`) are read by `appliance plan` and the console,
so importing this package imports nothing: each kernel module is imported by name.
"""
