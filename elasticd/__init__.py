"""elasticd: fault-tolerant elastic training for PyTorch on an etcd v3 control plane."""

__version__ = "0.1.0"
