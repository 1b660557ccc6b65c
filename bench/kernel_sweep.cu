// Bandwidth sweep of the swap/copy loop shapes of csrc/cuda/ops.cu (threads per block, vectors
// in flight per thread, .cs load/store hints, grid blocks per SM), against cudaMemcpyAsync D2D, on
// 512 MiB in 16 buffers. Standalone: not built with graphctl. On a GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/sweep bench/kernel_sweep.cu && /tmp/sweep
// Results: bench/RESULTS.md, switch_cost (issue 19 runs).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#define CK(x)                                                      \
  do {                                                             \
    cudaError_t e = (x);                                           \
    if (e != cudaSuccess) {                                        \
      printf("err %s line %d\n", cudaGetErrorString(e), __LINE__); \
      return 1;                                                    \
    }                                                              \
  } while (0)

struct E {
  const char* from;
  char* to;
  const char* refill;
  int64_t nbytes;
  int64_t tile_start;
};
struct T {
  int n;
  int64_t total;
  E e[16];
};

template <int TH, int UN, bool SWAP, bool STCS, bool LDCS>
__global__ void __launch_bounds__(TH) k(const __grid_constant__ T t) {
  constexpr int64_t TILE = (int64_t)TH * 16 * UN;
  for (int64_t tile = blockIdx.x; tile < t.total; tile += gridDim.x) {
    int lo = 0, hi = t.n - 1;
    while (lo < hi) {
      int mid = (lo + hi + 1) >> 1;
      if (t.e[mid].tile_start <= tile)
        lo = mid;
      else
        hi = mid - 1;
    }
    const E& e = t.e[lo];
    int64_t off = (tile - e.tile_start) * TILE;
    int64_t nvec = min(TILE, e.nbytes - off) / 16;
    const uint4* src = reinterpret_cast<const uint4*>(e.from + off);
    uint4* dst = reinterpret_cast<uint4*>(e.to + off);
    const uint4* rf = SWAP ? reinterpret_cast<const uint4*>(e.refill + off) : nullptr;
    uint4 a[UN], b[UN];
#pragma unroll
    for (int j = 0; j < UN; ++j) {
      int64_t i = threadIdx.x + j * TH;
      if (i < nvec) {
        a[j] = src[i];
        if (SWAP) b[j] = LDCS ? __ldcs(rf + i) : rf[i];
      }
    }
#pragma unroll
    for (int j = 0; j < UN; ++j) {
      int64_t i = threadIdx.x + j * TH;
      if (i < nvec) {
        if (STCS)
          __stcs(dst + i, a[j]);
        else
          dst[i] = a[j];
        if (SWAP) const_cast<uint4*>(src)[i] = b[j];
      }
    }
  }
}

template <int TH, int UN, bool SWAP, bool STCS, bool LDCS>
float run(char** s, char** d, char** r, int64_t nb, int nbuf, int gridmul, int sms) {
  T t;
  t.n = nbuf;
  t.total = 0;
  constexpr int64_t TILE = (int64_t)TH * 16 * UN;
  for (int i = 0; i < nbuf; ++i) {
    t.e[i] = {s[i], d[i], r[i], nb, t.total};
    t.total += (nb + TILE - 1) / TILE;
  }
  int grid = (int)std::min<int64_t>(t.total, (int64_t)sms * gridmul);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) k<TH, UN, SWAP, STCS, LDCS><<<grid, TH>>>(t);
  float best = 1e9, tot = 0;
  int reps = 50;
  float ts[50];
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    k<TH, UN, SWAP, STCS, LDCS><<<grid, TH>>>(t);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ts[i], a, b);
  }
  // median
  for (int i = 0; i < reps; ++i)
    for (int j = i + 1; j < reps; ++j)
      if (ts[j] < ts[i]) {
        float x = ts[i];
        ts[i] = ts[j];
        ts[j] = x;
      }
  (void)best;
  (void)tot;
  return ts[reps / 2];
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int nbuf = 16;
  const int64_t nb = (512ll << 20) / nbuf;
  char *s[nbuf], *d[nbuf], *r[nbuf];
  for (int i = 0; i < nbuf; ++i) {
    CK(cudaMalloc(&s[i], nb));
    CK(cudaMalloc(&d[i], nb));
    CK(cudaMalloc(&r[i], nb));
    cudaMemset(s[i], 1, nb);
    cudaMemset(r[i], 2, nb);
  }
  char *fs, *fd;
  CK(cudaMalloc(&fs, nb * nbuf));
  CK(cudaMalloc(&fd, nb * nbuf));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  float ts[50];
  for (int i = 0; i < 5; ++i) cudaMemcpyAsync(fd, fs, nb * nbuf, cudaMemcpyDeviceToDevice);
  for (int i = 0; i < 50; ++i) {
    cudaEventRecord(a);
    cudaMemcpyAsync(fd, fs, nb * nbuf, cudaMemcpyDeviceToDevice);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ts[i], a, b);
  }
  for (int i = 0; i < 50; ++i)
    for (int j = i + 1; j < 50; ++j)
      if (ts[j] < ts[i]) {
        float x = ts[i];
        ts[i] = ts[j];
        ts[j] = x;
      }
  double data = (double)nb * nbuf;
  double memcpy_bw = 2 * data / (ts[25] / 1e3) / 1e9;
  printf("memcpy D2D: %.0f GB/s\n", memcpy_bw);
#define V(TH, UN, ST, LD, GM)                                                                                          \
  {                                                                                                                    \
    float c = run<TH, UN, false, ST, LD>(s, d, r, nb, nbuf, GM, sms);                                                  \
    float w = run<TH, UN, true, ST, LD>(s, d, r, nb, nbuf, GM, sms);                                                   \
    printf("th %d un %d stcs %d ldcs %d grid %dx: copy %.0f GB/s (%.3f)  swap %.0f GB/s (%.3f)\n", TH, UN, ST, LD, GM, \
           2 * data / (c / 1e3) / 1e9, 2 * data / (c / 1e3) / 1e9 / memcpy_bw, 4 * data / (w / 1e3) / 1e9,             \
           4 * data / (w / 1e3) / 1e9 / memcpy_bw);                                                                    \
  }
  V(256, 4, true, true, 64)
  V(256, 4, false, false, 64)
  V(256, 4, true, true, 8)
  V(256, 4, false, true, 4)
  V(256, 8, false, false, 64)
  V(256, 8, true, true, 8)
  V(256, 8, false, false, 8)
  V(512, 4, false, false, 4)
  V(512, 8, false, false, 4)
  V(128, 8, false, false, 16)
  V(256, 2, false, false, 64)
  V(1024, 4, false, false, 2)
  V(256, 16, false, false, 8)
  return 0;
}
