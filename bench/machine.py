"""What machine a benchmark ran on: recorded in every result, since kernels (MKL, oneDNN,
faiss, our SIMD) pick their code by CPU features and sessions land on different hosts."""
import os


def describe():
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"cpu_model": model, "simd": simd, "avx512_bf16": "avx512_bf16" in flags, "cpus": os.cpu_count()}
