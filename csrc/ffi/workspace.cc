// Workspace sizes of the CUDA handlers, exported for the JAX ops, which allocate each workspace as
// an extra result of the custom call (sized from static shapes, so no per-call cudaMalloc).
#include <cstdint>

#include "nodrop/engine_cuda.h"
#include "nodrop/engine_cuda_moe.h"

extern "C" {

int64_t NodropGroupedMatmulWorkspaceBytes(int64_t num_groups) {
  return static_cast<int64_t>(nodrop::cuda::grouped_matmul_workspace_bytes(num_groups));
}

int64_t NodropSortByExpertWorkspaceBytes(int64_t num_tokens, int64_t k, int64_t num_experts) {
  return static_cast<int64_t>(
      nodrop::cuda::sort_by_expert_workspace_bytes(num_tokens, k, num_experts));
}

}  // extern "C"
