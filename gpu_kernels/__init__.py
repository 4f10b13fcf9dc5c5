"""CUDA kernels as real `.cu` files, their JIT loader, and a numpy twin of
every kernel (the test oracle and the CPU path)."""
