// Ragged-batch FA3 attention (Hopper) with the project's own tile shape.
//
// FlashInfer's packaged FA3 module fixes the tile at head_dim 64 to 192 query rows x 128
// keys. A 518x378 frame has 1005 tokens: 6 tiles of 192 rows compute 1152 rows, 12.5% more
// than the 1024 of 8 tiles of 128 rows. This file instantiates FlashInfer's SM90 kernel
// templates (the library's headers, unchanged) with LINGBOT_TILE_Q x LINGBOT_TILE_KV tiles
// and brings its own work schedule for the kernel's persistent tile scheduler, which
// FlashInfer's plan would size for 192-row tiles.
//
// Exported through TVM-FFI (the binding layer FlashInfer's own modules use):
//   plan(qo_indptr, kv_indptr, num_heads, num_ctas, capacity, schedule) -> works
//       host int32 arrays in, host int32 schedule out (layout below)
//   run(q, k, v, o, lse?, schedule, num_ctas, capacity, sm_scale, stream)
//       q/o [nnz_qo, H, 64], k/v [nnz_kv, H, 64] (bf16, last dim contiguous), lse [nnz_qo, H]
//       fp32 in the convention of FlashInfer's kernels (what kernels.merge reads), schedule
//       the device copy of plan's output, stream the CUDA stream to launch on.
//
// Schedule layout (int32): work_indptr[num_ctas + 1], then seven arrays of `capacity`
// entries, one entry per work item (a query tile of one head of one request):
// qo tile index, request's first query row, its first key row, its query count, its key
// count, head, request index.
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>
#include <flashinfer/cutlass_utils.cuh>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

#ifndef LINGBOT_TILE_Q
#define LINGBOT_TILE_Q 128
#endif
#ifndef LINGBOT_TILE_KV
#define LINGBOT_TILE_KV 192
#endif
#ifndef LINGBOT_STAGES
#define LINGBOT_STAGES 2
#endif

namespace lingbot_fa3 {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

constexpr int kTileQ = LINGBOT_TILE_Q;
constexpr int kTileKV = LINGBOT_TILE_KV;
constexpr int kStages = LINGBOT_STAGES;  // K/V tiles in flight (TMA pipeline depth)
constexpr int kHeadDim = 64;
constexpr int kItemArrays = 7;

// What FlashInfer's StandardAttention variant reads (the softmax scale). Without a V scale
// pair of members the variant scales V by 1.
struct ScaleParams {
  double sm_scale;
};

using Element = cutlass::bfloat16_t;

// The fields FlashInfer's ragged dispatch reads from its Params argument.
struct RaggedParams {
  using DTypeQ = Element;
  using DTypeKV = Element;
  using DTypeO = Element;
  using IdType = int32_t;
  using AdditionalParams = ScaleParams;

  Element* q_ptr;
  Element* k_ptr;
  Element* v_ptr;
  Element* o_ptr;
  float* lse_ptr;

  int32_t* qo_tile_indices;
  int32_t* qo_indptr;
  int32_t* kv_indptr;
  int32_t* qo_lens;
  int32_t* kv_lens;
  int32_t* head_indices;
  int32_t* work_indptr;
  int32_t* batch_indices;

  AdditionalParams additional_params;

  int64_t q_stride_n, k_stride_n, v_stride_n, o_stride_n;
  int64_t q_stride_h, k_stride_h, v_stride_h, o_stride_h;
  int64_t nnz_qo, nnz_kv;
  int num_qo_heads, num_kv_heads, window_left;
};

using Traits = flashinfer::AttentionKernelTraits<
    /*USE_TMA_LOAD_KV=*/true, kHeadDim, kHeadDim, kTileQ, kTileKV, kStages, Element,
    Element, Element, int32_t, flashinfer::StandardAttention>;

bool OnHost(const TensorView& t) {
  const auto type = t.device().device_type;
  return (type == kDLCPU || type == kDLCUDAHost) && t.ndim() == 1 && t.stride(0) == 1;
}

int64_t ScheduleSize(int64_t num_ctas, int64_t capacity) {
  return num_ctas + 1 + kItemArrays * capacity;
}

// Longest-first list scheduling: requests by descending key count; each query tile of each
// head goes to the CTA with the least estimated work so far (ties: lowest index). A tile's
// cost is its keys plus a fixed 2 x tile rows (loading the queries, writing the output).
// Python twin (CPU tests): lingbot_map_ros.kernels.fa3_tiles.plan_reference.
int64_t Plan(TensorView qo_indptr, TensorView kv_indptr, int64_t num_heads, int64_t num_ctas,
             int64_t capacity, TensorView schedule) {
  TVM_FFI_ICHECK(OnHost(qo_indptr) && OnHost(kv_indptr) && OnHost(schedule))
      << "plan takes contiguous host tensors";
  TVM_FFI_ICHECK(qo_indptr.dtype().code == kDLInt && qo_indptr.dtype().bits == 32 &&
                 kv_indptr.dtype().code == kDLInt && kv_indptr.dtype().bits == 32 &&
                 schedule.dtype().code == kDLInt && schedule.dtype().bits == 32)
      << "plan takes int32 tensors";
  TVM_FFI_ICHECK(qo_indptr.ndim() == 1 && kv_indptr.ndim() == 1 &&
                 qo_indptr.size(0) == kv_indptr.size(0) && qo_indptr.size(0) >= 1)
      << "qo_indptr and kv_indptr must be 1-d and of equal length";
  TVM_FFI_ICHECK(num_heads > 0 && num_ctas > 0 && capacity >= 0) << "bad plan sizes";
  TVM_FFI_ICHECK(schedule.ndim() == 1 && schedule.size(0) >= ScheduleSize(num_ctas, capacity))
      << "schedule buffer holds " << schedule.size(0) << " entries, needs "
      << ScheduleSize(num_ctas, capacity);
  const int32_t* qo = static_cast<const int32_t*>(qo_indptr.data_ptr());
  const int32_t* kv = static_cast<const int32_t*>(kv_indptr.data_ptr());
  const int64_t batch = qo_indptr.size(0) - 1;

  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  for (int64_t r = 0; r < batch; ++r) {
    TVM_FFI_ICHECK(qo[r + 1] >= qo[r] && kv[r + 1] >= kv[r])
        << "indptr arrays must not decrease (request " << r << ")";
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return kv[a + 1] - kv[a] > kv[b + 1] - kv[b];
  });

  using Slot = std::pair<int64_t, int64_t>;  // (estimated work, cta)
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> idle;
  for (int64_t c = 0; c < num_ctas; ++c) idle.push({0, c});
  struct Item {
    int32_t request, head, tile;
  };
  std::vector<std::vector<Item>> lists(num_ctas);
  int64_t works = 0;
  for (int64_t r : order) {
    const int64_t rows = qo[r + 1] - qo[r];
    const int64_t keys = kv[r + 1] - kv[r];
    const int64_t tiles = (rows + kTileQ - 1) / kTileQ;
    const int64_t cost = keys + 2 * kTileQ;
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int64_t t = tiles - 1; t >= 0; --t) {
        Slot s = idle.top();
        idle.pop();
        lists[s.second].push_back({int32_t(r), int32_t(h), int32_t(t)});
        idle.push({s.first + cost, s.second});
        ++works;
      }
    }
  }
  TVM_FFI_ICHECK(works <= capacity)
      << works << " work items exceed the schedule's capacity of " << capacity;

  int32_t* work_indptr = static_cast<int32_t*>(schedule.data_ptr());
  int32_t* tile_of = work_indptr + num_ctas + 1;
  int32_t* qo_start = tile_of + capacity;
  int32_t* kv_start = qo_start + capacity;
  int32_t* qo_len = kv_start + capacity;
  int32_t* kv_len = qo_len + capacity;
  int32_t* head_of = kv_len + capacity;
  int32_t* request_of = head_of + capacity;
  int64_t w = 0;
  work_indptr[0] = 0;
  for (int64_t c = 0; c < num_ctas; ++c) {
    for (const Item& it : lists[c]) {
      tile_of[w] = it.tile;
      qo_start[w] = qo[it.request];
      kv_start[w] = kv[it.request];
      qo_len[w] = qo[it.request + 1] - qo[it.request];
      kv_len[w] = kv[it.request + 1] - kv[it.request];
      head_of[w] = it.head;
      request_of[w] = it.request;
      ++w;
    }
    work_indptr[c + 1] = int32_t(w);
  }
  return works;
}

bool IsBf16(const TensorView& t) {
  return t.dtype().code == kDLBfloat && t.dtype().bits == 16 && t.dtype().lanes == 1;
}

void CheckRows(const TensorView& t, const char* name, int64_t heads) {
  TVM_FFI_ICHECK(t.device().device_type == kDLCUDA) << name << " must be on the GPU";
  TVM_FFI_ICHECK(IsBf16(t)) << name << " must be bfloat16";
  TVM_FFI_ICHECK(t.ndim() == 3 && t.size(2) == kHeadDim && t.stride(2) == 1)
      << name << " must be [rows, heads, " << kHeadDim << "] with contiguous last dim";
  TVM_FFI_ICHECK(t.size(1) == heads) << name << " has " << t.size(1) << " heads, expected "
                                     << heads;
  TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
                 t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0)
      << name << " must be 16-byte aligned (TMA)";
}

void Run(TensorView q, TensorView k, TensorView v, TensorView o, Optional<TensorView> lse,
         TensorView schedule, int64_t num_ctas, int64_t capacity, double sm_scale,
         int64_t stream) {
  const int64_t heads = q.size(1);
  CheckRows(q, "q", heads);
  CheckRows(k, "k", heads);
  CheckRows(v, "v", heads);
  CheckRows(o, "o", heads);
  TVM_FFI_ICHECK(o.size(0) == q.size(0)) << "o must have q's rows";
  TVM_FFI_ICHECK(k.size(0) == v.size(0)) << "k and v must have the same rows";
  TVM_FFI_ICHECK(schedule.device().device_type == kDLCUDA && schedule.dtype().code == kDLInt &&
                 schedule.dtype().bits == 32 && schedule.ndim() == 1 &&
                 schedule.size(0) >= ScheduleSize(num_ctas, capacity))
      << "schedule must be a device int32 tensor of at least "
      << ScheduleSize(num_ctas, capacity) << " entries";
  int device = q.device().device_id;
  int sms = 0;
  TVM_FFI_ICHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) ==
                 cudaSuccess);
  TVM_FFI_ICHECK(sms == num_ctas) << "the schedule was planned for " << num_ctas
                                  << " CTAs but the kernel launches one per SM (" << sms << ")";
  float* lse_ptr = nullptr;
  if (lse.has_value()) {
    const TensorView& l = lse.value();
    TVM_FFI_ICHECK(l.device().device_type == kDLCUDA && l.dtype().code == kDLFloat &&
                   l.dtype().bits == 32 && l.ndim() == 2 && l.size(0) == q.size(0) &&
                   l.size(1) == heads && l.stride(1) == 1 && l.stride(0) == heads)
        << "lse must be a contiguous float32 [rows, heads] tensor";
    lse_ptr = static_cast<float*>(l.data_ptr());
  }

  RaggedParams p;
  p.q_ptr = static_cast<Element*>(q.data_ptr());
  p.k_ptr = static_cast<Element*>(k.data_ptr());
  p.v_ptr = static_cast<Element*>(v.data_ptr());
  p.o_ptr = static_cast<Element*>(o.data_ptr());
  p.lse_ptr = lse_ptr;
  int32_t* base = static_cast<int32_t*>(schedule.data_ptr());
  p.work_indptr = base;
  p.qo_tile_indices = base + num_ctas + 1;
  p.qo_indptr = p.qo_tile_indices + capacity;
  p.kv_indptr = p.qo_indptr + capacity;
  p.qo_lens = p.kv_indptr + capacity;
  p.kv_lens = p.qo_lens + capacity;
  p.head_indices = p.kv_lens + capacity;
  p.batch_indices = p.head_indices + capacity;
  p.additional_params.sm_scale = sm_scale;
  p.q_stride_n = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_n = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.v_stride_n = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.o_stride_n = o.stride(0);
  p.o_stride_h = o.stride(1);
  p.nnz_qo = q.size(0);
  p.nnz_kv = k.size(0);
  p.num_qo_heads = int(heads);
  p.num_kv_heads = int(heads);
  p.window_left = -1;

  int previous = 0;  // the dispatch reads the current device's SM count
  TVM_FFI_ICHECK(cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(device) == cudaSuccess);
  cudaError_t status = flashinfer::BatchPrefillWithRaggedKVCacheKernelTraitsDispatched<
      Traits, /*LEFT_SLIDING_WINDOW=*/false, /*CAUSAL=*/false,
      /*SAME_SCHEDULE_FOR_ALL_HEADS=*/false>(p, reinterpret_cast<cudaStream_t>(stream));
  if (status == cudaSuccess) status = cudaGetLastError();
  cudaSetDevice(previous);
  TVM_FFI_ICHECK(status == cudaSuccess)
      << "FA3 ragged attention launch failed: " << cudaGetErrorString(status);
}

int64_t TileQ() { return kTileQ; }
int64_t TileKV() { return kTileKV; }
int64_t Stages() { return kStages; }

}  // namespace lingbot_fa3

TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, lingbot_fa3::Plan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, lingbot_fa3::Run);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(tile_q, lingbot_fa3::TileQ);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(tile_kv, lingbot_fa3::TileKV);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(stages, lingbot_fa3::Stages);
