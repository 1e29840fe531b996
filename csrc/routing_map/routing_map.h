// The routing map of an MoE layer: for each routed token slot (t, j), the
// row of the grouped (expert-ordered) buffer it goes to.  Slot s = t*k + j
// names expert e = indices[s]; values outside [0, experts) mark a slot the
// router dropped.  Within an expert, slots keep their flat order s (token,
// then j): a stable counting sort, in three launches and no host sync.
//
//   1. count   per chunk of kChunkSlots slots, valid slots per expert:
//              counts[chunk][e] (chunk-major, coalesced writes)
//   2. scan    per expert, the exclusive prefix of those counts over the
//              chunks (in place) and the expert's total
//   3. rank    per chunk, one warp walks its slots 32 at a time: a slot's
//              rank in its expert is the chunk's prefix plus the same
//              expert's slots before it (warp match + popcount, a running
//              count per expert in shared memory).  Every CTA also scans
//              the kept counts min(total, capacity) over the experts for
//              the packed layout's expert offsets; CTA 0 writes m_splits,
//              the kept total and the dropped count.
//
// Layouts: packed (row = offset[e] + rank, experts back to back) or padded
// (row = e * capacity + rank).  With a capacity an expert keeps its first
// `capacity` slots; the others, and invalid slots, map to -1.  Integer
// arithmetic only, so the map equals lpmoe/moe/routing_map.py's PyTorch
// formulation exactly (the tests compare them).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace lpmoe {
namespace routing_map {

constexpr int kMaxExperts = 1024;   // a per-warp running count per expert in shared memory
constexpr int kWarpsPerCta = 8;
constexpr int kRoundsPerChunk = 16;
constexpr int kChunkSlots = 32 * kRoundsPerChunk;  // one warp's chunk

struct Args {
  const void* indices = nullptr;  // (slots,) expert per slot, int32 or int64
  bool indices_int64 = true;
  int64_t slots = 0;              // tokens * k (< 2^31)
  int experts = 0;
  int64_t capacity = -1;          // rows kept per expert; -1 = no limit
  bool padded = false;            // row = e * capacity + rank (needs capacity >= 0)
  int32_t* counts = nullptr;      // (chunks(slots), experts) scratch
  int32_t* totals = nullptr;      // (experts,) scratch: valid slots per expert
  int32_t* row_map = nullptr;     // (slots,) out: grouped row, -1 = not routed
  int64_t* m_splits = nullptr;    // (experts,) out: rows kept per expert
  int64_t* used = nullptr;        // (1,) out: kept total (packed layout), or null
  int64_t* dropped = nullptr;     // (1,) out: valid slots over capacity
};

__host__ __device__ inline int64_t chunks(int64_t slots) { return (slots + kChunkSlots - 1) / kChunkSlots; }

cudaError_t launch_routing_map(const Args& args, cudaStream_t stream);

}  // namespace routing_map
}  // namespace lpmoe
