// quant8_adam.cpp's kernel as a torch operator: TORCH_EXTENSION_NAME::adam8bit_step_,
// CPU only. _quant8_fused.py builds both files with torch.utils.cpp_extension.load; the
// build's name (the namespace here) carries the hash of the sources, flags and CPU, so
// two builds (native and portable) can live in one process.
//
// [Note: threads over blocks]
// The step runs on torch's intra-op threads (at::parallel_for, torch.get_num_threads()):
// each thread takes a run of whole blocks, at least kGrain elements, and blocks never
// interact, so the bits are the same at any thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>

#include "quant8_adam.h"

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements a thread takes at least (enough work to repay its start)

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
    TORCH_CHECK(t.device().is_cpu(), "adam8bit_step_: ", name, " must be a CPU tensor, got ",
                t.device());
    TORCH_CHECK(t.scalar_type() == dtype, "adam8bit_step_: ", name, " must be ", dtype, ", got ",
                t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), "adam8bit_step_: ", name, " must be contiguous");
    TORCH_CHECK(t.numel() == numel, "adam8bit_step_: ", name, " must have ", numel,
                " elements, got ", t.numel());
}

void adam8bit_step_cpu(const at::Tensor& p, const at::Tensor& g, const at::Tensor& mc,
                       const at::Tensor& ma, const at::Tensor& vc, const at::Tensor& va,
                       int64_t block_size, c10::ArrayRef<double> hp, int64_t flags,
                       const at::Tensor& scode, const at::Tensor& ucode, const at::Tensor& stab,
                       const at::Tensor& utab) {
    const int64_t n = p.numel();
    TORCH_CHECK(block_size >= 1, "adam8bit_step_: block_size must be >= 1, got ", block_size);
    TORCH_CHECK(hp.size() == 8, "adam8bit_step_: hp must hold 8 coefficients, got ", hp.size());
    const int64_t nb = (n + block_size - 1) / block_size;
    check(p, "p", at::kFloat, n);
    check(g, "g", at::kFloat, n);
    check(mc, "mc", at::kByte, n);
    check(vc, "vc", at::kByte, n);
    check(ma, "ma", at::kFloat, nb);
    check(va, "va", at::kFloat, nb);
    check(scode, "scode", at::kFloat, 256);
    check(ucode, "ucode", at::kFloat, 256);
    check(stab, "stab", at::kInt, 65536);
    check(utab, "utab", at::kInt, 65536);
    std::array<float, 8> h{};  // each coefficient is a float32 already: exact
    for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>(hp[i]);
    float* pp = p.data_ptr<float>();
    const float* gp = g.data_ptr<float>();
    uint8_t* mcp = mc.data_ptr<uint8_t>();
    uint8_t* vcp = vc.data_ptr<uint8_t>();
    float* map = ma.data_ptr<float>();
    float* vap = va.data_ptr<float>();
    const float* sc = scode.data_ptr<float>();
    const float* uc = ucode.data_ptr<float>();
    const auto* st = reinterpret_cast<const uint32_t*>(stab.data_ptr<int32_t>());
    const auto* ut = reinterpret_cast<const uint32_t*>(utab.data_ptr<int32_t>());
    std::atomic<int> rc{0};
    const int64_t grain = std::max<int64_t>(1, kGrain / block_size);  // in blocks
    at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
        const int64_t lo = b0 * block_size, hi = std::min(n, b1 * block_size);
        if (vefsdp::adam8bit_step(pp + lo, gp + lo, mcp + lo, map + b0, vcp + lo, vap + b0, hi - lo,
                                  block_size, h.data(), static_cast<int>(flags), sc, uc, st, ut) != 0)
            rc = -1;
    });
    TORCH_CHECK(rc == 0, "adam8bit_step_: no memory for a scratch of ~4 * ", block_size, " floats");
}

}  // namespace

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
    m.def(
        "adam8bit_step_(Tensor(a!) p, Tensor g, Tensor(b!) mc, Tensor(c!) ma, Tensor(d!) vc, "
        "Tensor(e!) va, int block_size, float[] hp, int flags, Tensor scode, Tensor ucode, "
        "Tensor stab, Tensor utab) -> ()");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
    m.impl("adam8bit_step_", &adam8bit_step_cpu);
}
