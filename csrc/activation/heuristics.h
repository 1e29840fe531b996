// Variant choice of the fused activation kernels (heuristics.cu).
#pragma once

#include "activation/activation.h"

namespace lpmoe {
namespace activation {

// Peak DRAM bytes per SM per SM clock cycle of `device` (0 if unknown).
double dram_bytes_per_sm_cycle(int device);

// Whether a bf16 SwiGLU launch on the current device takes the sigmoid table.
bool use_sigmoid_table(const Common& c);

void count_sigmoid_table_launch();

}  // namespace activation
}  // namespace lpmoe
