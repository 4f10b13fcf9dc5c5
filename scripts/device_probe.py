"""Facts about the GPU machine that the design depends on, printed as JSON:
versions, whether a /dev/shm mapping can be registered with CUDA and written by
a kernel, whether dynamic parallelism links through CuPy, and libpmem presence."""

import ctypes.util
import json
import mmap
import os
import sys
import time

facts = {"python": sys.version.split()[0]}
try:
    import cupy as cp

    facts["cupy"] = cp.__version__
    facts["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
    facts["driver"] = cp.cuda.runtime.driverGetVersion()
    props = cp.cuda.runtime.getDeviceProperties(0)
    facts["device"] = props["name"].decode()
    facts["sms"] = props["multiProcessorCount"]
    facts["canMapHostMemory"] = props["canMapHostMemory"]
    # Register a /dev/shm mapping and let a kernel write into it.
    n = 64 << 20
    path = "/dev/shm/concordia-probe"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n)
    import numpy as np

    host = np.frombuffer(mm, dtype=np.uint8)
    ptr = host.ctypes.data
    try:
        cp.cuda.runtime.hostRegister(ptr, n, 2)  # cudaHostRegisterMapped
        dptr = ptr  # unified addressing: a mapped registration has the same address on the device
        mem = cp.cuda.UnownedMemory(dptr, n, None)
        dev = cp.ndarray(n, dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        src = cp.arange(n, dtype=cp.uint32).view(cp.uint8)[:n]
        k = cp.RawKernel(r'''extern "C" __global__ void cp16(const uint4* s, uint4* d, size_t n){
            for (size_t i = blockIdx.x*(size_t)blockDim.x+threadIdx.x; i < n; i += (size_t)gridDim.x*blockDim.x) d[i]=s[i]; }''', "cp16")
        k((1024,), (256,), (src, dev, np.uint64(n // 16)))
        cp.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            k((1024,), (256,), (src, dev, np.uint64(n // 16)))
        cp.cuda.runtime.deviceSynchronize()
        dt = (time.perf_counter() - t0) / 10
        facts["shm_register_ok"] = bool((host[:4096] == src[:4096].get()).all() and (host[-4096:] == src[-4096:].get()).all())
        facts["gpu_write_to_shm_GBps"] = round(n / dt / 1e9, 1)
        cp.cuda.runtime.hostUnregister(ptr)
    except Exception as exc:
        facts["shm_register_error"] = repr(exc)
    del host
    mm.close(); os.close(fd); os.unlink(path)
    # A file on the page cache: does registration get refused?
    try:
        fpath = "/tmp/concordia-probe-file"
        fd = os.open(fpath, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 20)
        mm = mmap.mmap(fd, 1 << 20)
        a = np.frombuffer(mm, dtype=np.uint8)
        try:
            cp.cuda.runtime.hostRegister(a.ctypes.data, 1 << 20, 2)
            facts["file_register"] = "accepted"
            cp.cuda.runtime.hostUnregister(a.ctypes.data)
        except Exception as exc:
            facts["file_register"] = f"refused: {exc}"
        del a
        mm.close(); os.close(fd); os.unlink(fpath)
    except Exception as exc:
        facts["file_register"] = repr(exc)
    # Dynamic parallelism through CuPy.
    try:
        t0 = time.perf_counter()
        src_dp = r'''extern "C" __global__ void child(int* x){ atomicAdd(x, 1); }
        extern "C" __global__ void parent(int* x){ if (threadIdx.x == 0) child<<<4, 32>>>(x); }'''
        m = cp.RawModule(code=src_dp, options=("-rdc=true",), jitify=False)
        m.compile()
        x = cp.zeros(1, dtype=cp.int32)
        m.get_function("parent")((1,), (1,), (x,))
        cp.cuda.runtime.deviceSynchronize()
        facts["dynamic_parallelism"] = {"ok": int(x.get()[0]) == 128, "compile_s": round(time.perf_counter() - t0, 3)}
    except Exception as exc:
        facts["dynamic_parallelism"] = repr(exc)
except Exception as exc:
    facts["cupy_error"] = repr(exc)
try:
    import torch

    facts["torch"] = torch.__version__
except Exception as exc:
    facts["torch"] = repr(exc)
try:
    import triton

    facts["triton"] = triton.__version__
except Exception as exc:
    facts["triton"] = repr(exc)
facts["libpmem"] = ctypes.util.find_library("pmem")
for mod in ("crc32c", "crcmod", "cffi", "lmdb", "concordia"):
    try:
        __import__(mod)
        facts[mod] = "ok"
    except Exception as exc:
        facts[mod] = repr(exc)
facts["nproc"] = os.cpu_count()
facts["cc"] = ctypes.util.find_library("c")
facts["gcc"] = os.popen("gcc --version 2>&1 | head -1").read().strip()
facts["nvcc"] = os.popen("nvcc --version 2>&1 | tail -1").read().strip()
facts["shm_free"] = os.popen("df -h /dev/shm | tail -1").read().strip()
print(json.dumps(facts, indent=1))
