// The keyed dropout mask of models/dropout.rs: compiled by NVRTC at run time into the CUDA
// kernel at the end (one pass, one byte an element), and by the host compiler into
// cuda_kernels.cpp's reference loop, which the tests hold to the Rust CPU fill bit for bit.
// Both call rak_fill_run, so what a GPU runs is the code the tests check but for the kernel's
// one line (its block is the run, its thread the first element, its block size the stride).
// No includes: NVRTC has no standard headers.
#ifdef __CUDACC_RTC__
#define RAK_FN __device__ __forceinline__
#else
#define RAK_FN inline
#endif

// Wellons' lowbias32 integer mixer (dropout.rs `mix`).
RAK_FN unsigned int rak_mix(unsigned int x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// The first key word of the run at middle coordinates (c1, c2) of an example keyed `key`, in
// the `call`-th dropout call of its pass (dropout.rs `run_key`: the coordinates fold as
// (c1 << 16) ^ c2; a tensor with fewer middle dimensions has c1 = 0, and c2 = 0 as well).
RAK_FN unsigned int rak_run_key(unsigned long long key, unsigned int call, unsigned int c1, unsigned int c2) {
  unsigned int call_key = rak_mix((unsigned int)key ^ (call * 0x9e3779b9u));
  return rak_mix(call_key ^ rak_mix((c1 << 16) ^ c2));
}

// Whether element j of a run keyed (k1, k2) is kept (dropout.rs `uniform24` >= threshold).
RAK_FN bool rak_keeps(unsigned int j, unsigned int k1, unsigned int k2, unsigned int threshold) {
  return (rak_mix(rak_mix(j ^ k1) ^ k2) >> 8) >= threshold;
}

// Elements j0, j0 + stride, ... below n of run `run` of a contiguous [B, m1, m2, n] mask,
// whose B example keys are `keys`: the run is (b, c1, c2) in row-major order, its bytes
// `out[run * n ...]`. The kernel calls this with its block's run and its thread's first
// element; the host reference with each run and every element.
RAK_FN void rak_fill_run(unsigned char* out, const unsigned long long* keys, unsigned int m1, unsigned int m2, unsigned int n,
                         unsigned int run, unsigned int j0, unsigned int stride, unsigned int call, unsigned int threshold) {
  const unsigned int c2 = run % m2;
  const unsigned int c1 = (run / m2) % m1;
  const unsigned long long key = keys[run / m2 / m1];
  const unsigned int k1 = rak_run_key(key, call, c1, c2);
  const unsigned int k2 = (unsigned int)(key >> 32);
  unsigned char* row = out + (unsigned long long)run * n;
  for (unsigned int j = j0; j < n; j += stride) row[j] = rak_keeps(j, k1, k2, threshold) ? 1 : 0;
}

#ifdef __CUDACC_RTC__
// One block a run, its threads striding over the run's elements (n < 2^31, so the stride
// cannot wrap).
extern "C" __global__ void rak_keyed_mask(unsigned char* out, const unsigned long long* keys, unsigned int m1, unsigned int m2,
                                          unsigned int n, unsigned int call, unsigned int threshold) {
  rak_fill_run(out, keys, m1, m2, n, blockIdx.x, threadIdx.x, blockDim.x, call, threshold);
}
#endif
