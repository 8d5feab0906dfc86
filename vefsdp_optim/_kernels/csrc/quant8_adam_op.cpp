// quant8_adam.cpp's kernel as a torch operator over lists of tensors:
// TORCH_EXTENSION_NAME::adam8bit_steps_, CPU only. _kernels/_native.py builds the files
// with torch.utils.cpp_extension.load; the build's name (the namespace here) carries the
// hash of the sources, flags and CPU, so two builds (native and portable) can live in
// one process.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <vector>

#include "quant8_adam.h"

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements a thread takes at least (enough work to repay its start)

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
    TORCH_CHECK(t.device().is_cpu(), "adam8bit_steps_: ", name, " must be a CPU tensor, got ",
                t.device());
    TORCH_CHECK(t.scalar_type() == dtype, "adam8bit_steps_: ", name, " must be ", dtype, ", got ",
                t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), "adam8bit_steps_: ", name, " must be contiguous");
    TORCH_CHECK(t.numel() == numel, "adam8bit_steps_: ", name, " must have ", numel,
                " elements, got ", t.numel());
}

struct Job {  // one tensor of adam8bit_steps_
    float* p;
    const float* g;
    uint8_t* mc;
    float* ma;
    uint8_t* vc;
    float* va;
    int64_t n;
    std::array<float, 8> h;
    int flags;
};

// The step runs on torch's intra-op threads (at::parallel_for, torch.get_num_threads()):
// each thread takes a run of whole blocks, at least kGrain elements, and blocks never
// interact, so the bits are the same at any thread count.
//
// adam8bit_steps_ takes lists: the blocks of all the tensors are numbered one after the
// other and cut into runs for the threads as one tensor's would be (a run may span the
// end of one tensor and the start of the next: two kernel calls). One Python call and
// one dispatch per bucket instead of one per tensor (the cost of each: docs/decisions.md),
// and small tensors share the threads. Each block is still its tensor's own: the same
// bits as one call per tensor.
void adam8bit_steps_cpu(at::TensorList p, at::TensorList g, at::TensorList mc, at::TensorList ma,
                        at::TensorList vc, at::TensorList va, int64_t block_size,
                        c10::ArrayRef<double> hp, c10::ArrayRef<int64_t> flags,
                        const at::Tensor& scode, const at::Tensor& ucode, const at::Tensor& stab,
                        const at::Tensor& utab) {
    const size_t nt = p.size();
    TORCH_CHECK(g.size() == nt && mc.size() == nt && ma.size() == nt && vc.size() == nt &&
                    va.size() == nt && flags.size() == nt,
                "adam8bit_steps_: p, g, mc, ma, vc, va and flags must have one entry per tensor, got ",
                nt, ", ", g.size(), ", ", mc.size(), ", ", ma.size(), ", ", vc.size(), ", ",
                va.size(), ", ", flags.size());
    TORCH_CHECK(hp.size() == 8 * nt, "adam8bit_steps_: hp must hold 8 coefficients per tensor (",
                8 * nt, "), got ", hp.size());
    TORCH_CHECK(block_size >= 1, "adam8bit_steps_: block_size must be >= 1, got ", block_size);
    check(scode, "scode", at::kFloat, 256);
    check(ucode, "ucode", at::kFloat, 256);
    check(stab, "stab", at::kInt, 65536);
    check(utab, "utab", at::kInt, 65536);
    std::vector<Job> jobs(nt);
    std::vector<int64_t> first(nt + 1, 0);  // first[i]: tensor i's first block in the joint count
    for (size_t i = 0; i < nt; ++i) {
        const int64_t n = p[i].numel(), nb = (n + block_size - 1) / block_size;
        check(p[i], "p", at::kFloat, n);
        check(g[i], "g", at::kFloat, n);
        check(mc[i], "mc", at::kByte, n);
        check(vc[i], "vc", at::kByte, n);
        check(ma[i], "ma", at::kFloat, nb);
        check(va[i], "va", at::kFloat, nb);
        Job& j = jobs[i];
        j.p = p[i].data_ptr<float>();
        j.g = g[i].data_ptr<float>();
        j.mc = mc[i].data_ptr<uint8_t>();
        j.ma = ma[i].data_ptr<float>();
        j.vc = vc[i].data_ptr<uint8_t>();
        j.va = va[i].data_ptr<float>();
        j.n = n;
        for (size_t k = 0; k < 8; ++k) j.h[k] = static_cast<float>(hp[8 * i + k]);
        j.flags = static_cast<int>(flags[i]);
        first[i + 1] = first[i] + nb;
    }
    const float* sc = scode.data_ptr<float>();
    const float* uc = ucode.data_ptr<float>();
    const auto* st = reinterpret_cast<const uint32_t*>(stab.data_ptr<int32_t>());
    const auto* ut = reinterpret_cast<const uint32_t*>(utab.data_ptr<int32_t>());
    std::atomic<int> rc{0};
    const int64_t grain = std::max<int64_t>(1, kGrain / block_size);  // in blocks
    at::parallel_for(0, first[nt], grain, [&](int64_t b0, int64_t b1) {
        // the tensor holding block b0, then each tensor the run reaches
        size_t i = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), b0) - first.begin()) - 1;
        for (int64_t b = b0; b < b1; ++i) {
            const int64_t e = std::min(b1, first[i + 1]);
            if (e <= b) continue;  // a tensor without blocks
            const Job& j = jobs[i];
            const int64_t lb = b - first[i], hb = e - first[i];
            const int64_t lo = lb * block_size, hi = std::min(j.n, hb * block_size);
            if (vefsdp::adam8bit_step(j.p + lo, j.g + lo, j.mc + lo, j.ma + lb, j.vc + lo, j.va + lb,
                                      hi - lo, block_size, j.h.data(), j.flags, sc, uc, st, ut) != 0)
                rc = -1;
            b = e;
        }
    });
    TORCH_CHECK(rc == 0, "adam8bit_steps_: no memory for a scratch of ~4 * ", block_size, " floats");
}

}  // namespace

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
    m.def(
        "adam8bit_steps_(Tensor(a!)[] p, Tensor[] g, Tensor(b!)[] mc, Tensor(c!)[] ma, "
        "Tensor(d!)[] vc, Tensor(e!)[] va, int block_size, float[] hp, int[] flags, Tensor scode, "
        "Tensor ucode, Tensor stab, Tensor utab) -> ()");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
    m.impl("adam8bit_steps_", &adam8bit_steps_cpu);
}
