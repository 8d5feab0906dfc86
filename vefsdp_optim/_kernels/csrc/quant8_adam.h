// The fused 8-bit Adam / AdamW step on the CPU (see vefsdp_optim/_kernels/_native.py): plain pointers, no torch headers, so that this
// translation unit builds in about a second; quant8_adam_op.cpp binds it as a torch op.
#pragma once

#include <stdint.h>

namespace vefsdp {

// One step on n elements in blocks of bs, in place: p, g float32 (n); mc, vc the uint8
// codes of the two moments (n); ma, va their float32 absmax (ceil(n / bs)).
// hp: c_wd, wd, 1-beta1, beta2, 1-beta2, sqrt(bias_correction2), eps, -step_size.
// flags: 1 maximize, 2 weight decay on, 4 decoupled (AdamW).
// scode, ucode: the signed and unsigned 256-value code maps; stab, utab: their
// TableQuantizer.packed tables (65536 words, _pack_buckets in vefsdp_optim/_math/_quant8.py).
// Returns 0, or -1 if the scratch (4 * bs + 2 * (bs / 16 + 1) floats) cannot be allocated.
int adam8bit_step(float* p, const float* g, uint8_t* mc, float* ma, uint8_t* vc, float* va,
                  int64_t n, int64_t bs, const float* hp, int flags, const float* scode,
                  const float* ucode, const uint32_t* stab, const uint32_t* utab);

}  // namespace vefsdp
