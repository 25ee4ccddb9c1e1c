"""Compute kernels that stand in for the model's plain math on particular hardware (cpu_kernels: eager CPU).

The bottom layer: it imports only torch, so the models and the loss may both use it.
"""
