import os

# Tests run on CPU/gloo; keep each process to one thread on this 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
