"""Units, once: byte multiples (binary, as CUDA and `nvidia-smi` report memory)."""
MIB = 2**20
GIB = 2**30
