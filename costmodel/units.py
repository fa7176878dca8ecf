"""Units, once: byte multiples (binary, as CUDA and `nvidia-smi` report memory)."""
KIB = 2**10
MIB = 2**20
GIB = 2**30
