// CUDA kernels of graphctl._C. Every op: one launch on the current stream for up to
// kMaxEntries buffers (the descriptor table travels by value as a __grid_constant__ kernel
// parameter, so it is baked into a graph node at capture and needs no device table), no
// host sync, no allocation except fingerprint's output through the caching allocator.
// Only c10's CUDA headers: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers, which a
// bare toolkit (the CI machine's) may not have.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../graphctl.h"

namespace graphctl {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 16;  // bytes per vector access
// 8 vectors in flight per thread: a sweep on the H200 (512 MiB, 16 buffers) gave 0.958 of
// cudaMemcpy's bandwidth for the swap at 8 against 0.917 at 4 with streaming (.cs) hints
constexpr int kUnroll = 8;
constexpr int64_t kTile = kThreads * kVec * kUnroll;  // 32 KiB of each buffer per block step
// Up to 32764 bytes of kernel parameters (CUDA >= 12.1, Volta+) at 40 bytes an entry. Two
// table sizes so a typical switch (tens of buffers) does not ship 30 KB of parameters per launch.
constexpr int kSmallEntries = 64;
constexpr int kMaxEntries = 768;

// One buffer of a launch. Each field means one thing in every op.
struct Entry {
  // The buffer read first: the static (swap_through_), the source (copy_), the buffer (fingerprint).
  const char* from;
  // Where `from`'s bytes go: the arena (swap_through_), the destination (copy_); unused by fingerprint.
  char* to;
  // swap_through_ only: written over `from` once read (nullptr: a snapshot only, nothing refilled).
  const char* refill;
  int64_t nbytes;      // the buffer's byte count
  int64_t tile_start;  // first tile of this entry in the launch
};

template <int N>
struct Table {
  static constexpr int kN = N;
  int32_t n;
  int64_t total_tiles;
  Entry e[N];
};
static_assert(sizeof(Table<kMaxEntries>) <= 32764, "kernel parameter table too large");

template <int N>
__device__ __forceinline__ int find_entry(const Table<N>& t, int64_t tile) {
  int lo = 0, hi = t.n - 1;  // last entry with tile_start <= tile
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (t.e[mid].tile_start <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// to = from; then, with kSwap and a refill, from = refill. Each byte is read and written by exactly
// one thread, so snapshot and apply cannot race.
template <bool kSwap, int N>
__global__ void __launch_bounds__(kThreads) swap_copy_kernel(const __grid_constant__ Table<N> t) {
  for (int64_t tile = blockIdx.x; tile < t.total_tiles; tile += gridDim.x) {
    const Entry& e = t.e[find_entry(t, tile)];
    const int64_t off = (tile - e.tile_start) * kTile;
    const int64_t len = min(kTile, e.nbytes - off);
    char* dst = e.to + off;
    char* mid = const_cast<char*>(e.from) + off;  // written only when refilled (swap_through_'s static)
    const bool apply = kSwap && e.refill != nullptr;
    const char* src = apply ? e.refill + off : nullptr;
    const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(mid) |
                           (apply ? reinterpret_cast<uintptr_t>(src) : 0)) %
                          kVec) == 0;
    int64_t done = 0;
    if (aligned) {
      const int64_t nvec = len / kVec;
      uint4 a[kUnroll], b[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        int64_t i = threadIdx.x + k * kThreads;
        if (i < nvec) {
          a[k] = reinterpret_cast<const uint4*>(mid)[i];
          if (apply) b[k] = reinterpret_cast<const uint4*>(src)[i];
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        int64_t i = threadIdx.x + k * kThreads;
        if (i < nvec) {
          // plain stores: streaming (.cs) hints on the arena cost 4% of the bandwidth in the sweep
          reinterpret_cast<uint4*>(dst)[i] = a[k];
          if (apply) reinterpret_cast<uint4*>(mid)[i] = b[k];
        }
      }
      done = nvec * kVec;
    }
    for (int64_t i = done + threadIdx.x; i < len; i += kThreads) {
      char v = mid[i];
      char w = apply ? src[i] : 0;
      dst[i] = v;
      if (apply) mid[i] = w;
    }
  }
}

template <int N>
__global__ void __launch_bounds__(kThreads)
    fingerprint_kernel(const __grid_constant__ Table<N> t, uint64_t* out, int base) {
  for (int64_t tile = blockIdx.x; tile < t.total_tiles; tile += gridDim.x) {
    const int idx = find_entry(t, tile);
    const Entry& e = t.e[idx];
    const int64_t off = (tile - e.tile_start) * kTile;  // multiple of 8: word indices stay global
    const int64_t len = e.nbytes > off ? min(kTile, e.nbytes - off) : 0;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(e.from) + off;
    const bool aligned8 = (reinterpret_cast<uintptr_t>(p) % 8) == 0;
    uint64_t acc = (off == 0 && threadIdx.x == 0) ? mix64(static_cast<uint64_t>(e.nbytes)) : 0;
    for (int64_t w = threadIdx.x; w * 8 < len; w += kThreads) {
      uint64_t word = 0;
      if (aligned8 && w * 8 + 8 <= len) {
        word = reinterpret_cast<const uint64_t*>(p)[w];
      } else {
        for (int k = 0; k < 8 && w * 8 + k < len; ++k) word |= static_cast<uint64_t>(p[w * 8 + k]) << (8 * k);
      }
      acc += fingerprint_term(static_cast<uint64_t>(off / 8 + w), word);
    }
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);
    __shared__ uint64_t warp_sums[kThreads / 32];
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint64_t total = 0;
      for (int k = 0; k < kThreads / 32; ++k) total += warp_sums[k];
      atomicAdd(reinterpret_cast<unsigned long long*>(out + base + idx), static_cast<unsigned long long>(total));
    }
    __syncthreads();
  }
}

int sm_count() {
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

int grid_for(int64_t tiles) {
  // One block per tile up to 64 blocks an SM (a 1 GiB switch), then blocks loop: a grid capped
  // at 8 blocks an SM reached only ~78% of torch's copy_ bandwidth on an H200.
  static const int sms = sm_count();  // one device kind per process in practice; only sizes the grid
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tiles, int64_t(sms) * 64)));
}

void check_cuda(at::TensorList l, const char* op) {
  check_on(l, op, c10::DeviceType::CUDA, "; call once per device (host buffers go through the CPU kernel)");
}

// Fill tables of at most N entries and launch each: one launch for up to kMaxEntries buffers.
template <int N, typename Fill, typename Launch>
void fill_and_launch(size_t n, bool min_one_tile, Fill& fill, Launch& launch) {
  for (size_t first = 0; first < n; first += N) {
    Table<N> t;
    t.n = 0;
    t.total_tiles = 0;
    size_t last = std::min(n, first + N);
    for (size_t i = first; i < last; ++i) {
      Entry& e = t.e[t.n++];
      fill(i, e);
      e.tile_start = t.total_tiles;
      int64_t tiles = (e.nbytes + kTile - 1) / kTile;
      t.total_tiles += min_one_tile ? std::max<int64_t>(tiles, 1) : tiles;
    }
    if (t.total_tiles > 0) launch(t, static_cast<int>(first));
  }
}

template <typename Fill, typename Launch>
void for_each_table(size_t n, bool min_one_tile, Fill fill, Launch launch) {
  if (n <= kSmallEntries) {
    fill_and_launch<kSmallEntries>(n, min_one_tile, fill, launch);
  } else {
    fill_and_launch<kMaxEntries>(n, min_one_tile, fill, launch);
  }
}

void swap_through_cuda(at::TensorList stat, at::TensorList arena, at::TensorList source) {
  check_lists("swap_through_", stat, "static", arena, "arena");
  check_lists("swap_through_", stat, "static", source, "source");
  if (stat.empty()) return;
  check_cuda(stat, "swap_through_");
  check_swap_overlaps(stat, arena, source);
  c10::cuda::CUDAGuard guard(stat[0].device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  for_each_table(
      stat.size(), false,
      [&](size_t i, Entry& e) {
        e.from = static_cast<const char*>(stat[i].data_ptr());
        e.to = static_cast<char*>(arena[i].data_ptr());
        const char* src = static_cast<const char*>(source[i].const_data_ptr());
        e.refill = src == e.from ? nullptr : src;  // the static itself as source: a snapshot only
        e.nbytes = nbytes(stat[i]);
      },
      [&](const auto& t, int) {
        swap_copy_kernel<true, std::decay_t<decltype(t)>::kN><<<grid_for(t.total_tiles), kThreads, 0, stream>>>(t);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

void copy_cuda(at::TensorList dst, at::TensorList src) {
  check_lists("copy_", dst, "dst", src, "src");
  if (dst.empty()) return;
  check_cuda(dst, "copy_");
  c10::cuda::CUDAGuard guard(dst[0].device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  std::vector<size_t> moved;  // a buffer copied onto itself moves nothing: left out of the launch
  moved.reserve(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    if (dst[i].data_ptr() != src[i].const_data_ptr()) moved.push_back(i);
  }
  for_each_table(
      moved.size(), false,
      [&](size_t j, Entry& e) {
        size_t i = moved[j];
        e.from = static_cast<const char*>(src[i].const_data_ptr());
        e.to = static_cast<char*>(dst[i].data_ptr());
        e.refill = nullptr;
        e.nbytes = nbytes(dst[i]);
      },
      [&](const auto& t, int) {
        swap_copy_kernel<false, std::decay_t<decltype(t)>::kN><<<grid_for(t.total_tiles), kThreads, 0, stream>>>(t);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

at::Tensor fingerprint_cuda(at::TensorList bufs) {
  check_cuda(bufs, "fingerprint");
  at::Tensor out = at::zeros({static_cast<int64_t>(bufs.size())}, bufs[0].options().dtype(at::kLong));
  c10::cuda::CUDAGuard guard(bufs[0].device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  for_each_table(
      bufs.size(), true,
      [&](size_t i, Entry& e) {
        e.from = static_cast<const char*>(bufs[i].const_data_ptr());
        e.to = nullptr;
        e.refill = nullptr;
        e.nbytes = dense_nbytes(bufs[i], "fingerprint", "bufs", i);
      },
      [&](const auto& t, int base) {
        fingerprint_kernel<std::decay_t<decltype(t)>::kN><<<grid_for(t.total_tiles), kThreads, 0, stream>>>(t, o, base);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

// Every block scans seq_lens into shared memory (cheap for S in the thousands), then maps its
// slice of tokens by binary search: out[t] = first r with cum[r] > t, i.e. searchsorted right.
template <typename O, typename S>
__global__ void __launch_bounds__(1024)
    token_to_request_kernel(O* out, int64_t out_n, const S* lens, int n_seq, int64_t num_tokens, O pad) {
  extern __shared__ int64_t smem[];
  int64_t* cum = smem;           // [n_seq]
  int64_t* part = smem + n_seq;  // [blockDim.x]
  const int per = (n_seq + blockDim.x - 1) / blockDim.x;
  const int lo = threadIdx.x * per, hi = min(n_seq, lo + per);
  int64_t run = 0;
  for (int i = lo; i < hi; ++i) run += max(int64_t(0), static_cast<int64_t>(lens[i]));  // a negative length counts as 0
  part[threadIdx.x] = run;
  __syncthreads();
  for (int s = 1; s < blockDim.x; s <<= 1) {  // Hillis-Steele inclusive scan of the per-thread sums
    int64_t v = threadIdx.x >= s ? part[threadIdx.x - s] : 0;
    __syncthreads();
    part[threadIdx.x] += v;
    __syncthreads();
  }
  run = threadIdx.x > 0 ? part[threadIdx.x - 1] : 0;
  for (int i = lo; i < hi; ++i) {
    run += max(int64_t(0), static_cast<int64_t>(lens[i]));  // a negative length counts as 0
    cum[i] = run;
  }
  __syncthreads();
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < out_n; t += int64_t(gridDim.x) * blockDim.x) {
    if (t >= num_tokens) {
      out[t] = pad;
      continue;
    }
    int a = 0, b = n_seq;  // first index with cum > t, in [0, n_seq]
    while (a < b) {
      int m = (a + b) >> 1;
      if (cum[m] > t)
        b = m;
      else
        a = m + 1;
    }
    out[t] = static_cast<O>(a);
  }
}

// One block: any(active) by a block-wide OR, then thread 0 writes the flag and, inside a graph,
// sets the WHILE node's condition (cudaGraphSetConditional, CUDA 12.3+, no -rdc needed).
__global__ void __launch_bounds__(256) loop_condition_kernel(int32_t* flag, const int64_t* counter, int64_t limit,
                                                             const bool* active, int64_t n, unsigned long long handle) {
  int mine = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mine |= active[i] ? 1 : 0;
  const int any = __syncthreads_or(mine);
  if (threadIdx.x == 0) {
    const unsigned value = (*counter < limit && any) ? 1u : 0u;
    *flag = static_cast<int32_t>(value);
    if (handle != 0) cudaGraphSetConditional(static_cast<cudaGraphConditionalHandle>(handle), value);
  }
}

void loop_condition_cuda(at::Tensor& flag, const at::Tensor& counter, int64_t limit, const at::Tensor& active,
                         int64_t handle) {
  TORCH_CHECK(flag.is_cuda(), "graphctl::loop_condition_ CUDA kernel got flag on ", flag.device());
  check_loop_condition(flag, counter, active);
  c10::cuda::CUDAGuard guard(flag.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  loop_condition_kernel<<<1, 256, 0, stream>>>(flag.data_ptr<int32_t>(), counter.const_data_ptr<int64_t>(), limit,
                                               active.const_data_ptr<bool>(), active.numel(),
                                               static_cast<unsigned long long>(handle));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void token_to_request_cuda(at::Tensor& out, const at::Tensor& seq_lens, int64_t num_tokens, int64_t pad_value) {
  TORCH_CHECK(out.is_cuda(), "graphctl::token_to_request_ CUDA kernel got out on ", out.device());
  check_token_to_request(out, seq_lens, num_tokens);
  const int64_t n_seq = seq_lens.numel();
  const int threads = 1024;
  const size_t shm = (n_seq + threads) * sizeof(int64_t);
  TORCH_CHECK(shm <= 200 * 1024, "graphctl::token_to_request_: ", n_seq,
              " sequences exceed the shared-memory scan (at most ~24K)");
  if (out.numel() == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>(std::min<int64_t>((out.numel() + threads - 1) / threads, 64));
  AT_DISPATCH_INDEX_TYPES(out.scalar_type(), "token_to_request_out", [&] {
    using O = index_t;
    AT_DISPATCH_INDEX_TYPES(seq_lens.scalar_type(), "token_to_request_lens", [&] {
      auto kernel = token_to_request_kernel<O, index_t>;
      if (shm > 48 * 1024) {
        C10_CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shm)));
      }
      kernel<<<blocks, threads, shm, stream>>>(out.data_ptr<O>(), out.numel(), seq_lens.const_data_ptr<index_t>(),
                                               static_cast<int>(n_seq), num_tokens, static_cast<O>(pad_value));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace
}  // namespace graphctl

TORCH_LIBRARY_IMPL(graphctl, CUDA, m) {
  m.impl("swap_through_", &graphctl::swap_through_cuda);
  m.impl("copy_", &graphctl::copy_cuda);
  m.impl("fingerprint", &graphctl::fingerprint_cuda);
  m.impl("token_to_request_", &graphctl::token_to_request_cuda);
  m.impl("loop_condition_", &graphctl::loop_condition_cuda);
}
