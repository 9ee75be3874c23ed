// Python-free check of the native FA2 objects.
//
//   fa2_link_check            list which kernel families were linked in (no GPU needed)
//   fa2_link_check --run      also run a few GQA/MQA forwards on GPU 0 against a CPU reference
//
// Built by `mqa-byoc build-kernels --link-check` (nvcc, static cudart) from this file, the dispatcher
// and the kernel objects.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "fa2_dispatch.h"

namespace {

struct Case {
  const char* name;
  int64_t b, sq, skv, h, hkv, d;
  int bf16, causal, wl, wr;
};

float to_float(uint16_t bits, int bf16) {
  if (bf16) {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}

uint16_t from_float(float f, int bf16) {
  if (bf16) {
    __nv_bfloat16 x = __float2bfloat16(f);
    uint16_t u;
    std::memcpy(&u, &x, 2);
    return u;
  }
  __half_raw r = __half_raw(__float2half(f));
  return r.x;
}

// out[b, i, h, :] = softmax(scale * q k^T + mask) v, K/V head h / (H / H_kv), bottom-right masks.
void reference(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v, std::vector<float>& o, float scale) {
  const int64_t g = c.h / c.hkv;
  std::vector<float> s(c.skv);
  for (int64_t b = 0; b < c.b; ++b)
    for (int64_t i = 0; i < c.sq; ++i)
      for (int64_t h = 0; h < c.h; ++h) {
        const int64_t kh = h / g;
        const int64_t diag = i + c.skv - c.sq;  // key index aligned with query row i
        float mx = -INFINITY;
        for (int64_t j = 0; j < c.skv; ++j) {
          bool ok = true;
          if (c.causal && j > diag) ok = false;
          if (c.wl >= 0 && j < diag - c.wl) ok = false;
          if (c.wr >= 0 && j > diag + c.wr) ok = false;
          float acc = 0.f;
          for (int64_t x = 0; x < c.d; ++x)
            acc += q[((b * c.sq + i) * c.h + h) * c.d + x] * k[((b * c.skv + j) * c.hkv + kh) * c.d + x];
          s[j] = ok ? acc * scale : -INFINITY;
          mx = std::max(mx, s[j]);
        }
        float sum = 0.f;
        for (int64_t j = 0; j < c.skv; ++j) {
          s[j] = std::isinf(s[j]) ? 0.f : std::exp(s[j] - mx);
          sum += s[j];
        }
        for (int64_t x = 0; x < c.d; ++x) {
          float acc = 0.f;
          for (int64_t j = 0; j < c.skv; ++j) acc += s[j] * v[((b * c.skv + j) * c.hkv + kh) * c.d + x];
          o[((b * c.sq + i) * c.h + h) * c.d + x] = sum > 0 ? acc / sum : 0.f;
        }
      }
}

int run_case(const Case& c) {
  const int hd = c.d <= 32 ? 32 : c.d <= 64 ? 64 : c.d <= 96 ? 96 : c.d <= 128 ? 128 : c.d <= 192 ? 192 : 256;
  if (!mqa_byoc_fa2_kernel_available(hd, c.bf16, c.causal, 0) && !mqa_byoc_fa2_kernel_available(hd, c.bf16, c.causal, 1)) {
    std::printf("SKIP %-28s (kernel hdim%d not linked)\n", c.name, hd);
    return 0;
  }
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  auto make = [&](int64_t n, std::vector<float>& f, std::vector<uint16_t>& raw) {
    f.resize(n);
    raw.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      raw[i] = from_float(dist(rng), c.bf16);
      f[i] = to_float(raw[i], c.bf16);
    }
  };
  const int64_t nq = c.b * c.sq * c.h * c.d, nk = c.b * c.skv * c.hkv * c.d;
  std::vector<float> qf, kf, vf, ref(nq);
  std::vector<uint16_t> qr, kr, vr, orr(nq);
  make(nq, qf, qr);
  make(nk, kf, kr);
  make(nk, vf, vr);
  const float scale = 1.f / std::sqrt(float(c.d));
  reference(c, qf, kf, vf, ref, scale);

  void *dq, *dk, *dv, *dout;
  cudaMalloc(&dq, nq * 2);
  cudaMalloc(&dk, nk * 2);
  cudaMalloc(&dv, nk * 2);
  cudaMalloc(&dout, nq * 2);
  cudaMemcpy(dq, qr.data(), nq * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, kr.data(), nk * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, vr.data(), nk * 2, cudaMemcpyHostToDevice);
  const int64_t qs[4] = {c.sq * c.h * c.d, c.h * c.d, c.d, 1};
  const int64_t ks[4] = {c.skv * c.hkv * c.d, c.hkv * c.d, c.d, 1};
  int rc = mqa_byoc_fa2_forward(dq, dk, dv, dout, c.b, c.sq, c.skv, c.h, c.hkv, c.d, qs, ks, ks, qs,
                                c.bf16, scale, c.causal, c.wl, c.wr, 0, nullptr);
  cudaError_t e = cudaDeviceSynchronize();
  int bad = 0;
  if (rc != 0 || e != cudaSuccess) {
    std::printf("FAIL %-28s rc=%d: %s / %s\n", c.name, rc, mqa_byoc_fa2_last_error(), cudaGetErrorString(e));
    bad = 1;
  } else {
    cudaMemcpy(orr.data(), dout, nq * 2, cudaMemcpyDeviceToHost);
    float err = 0.f;
    for (int64_t i = 0; i < nq; ++i) err = std::max(err, std::fabs(to_float(orr[i], c.bf16) - ref[i]));
    const float tol = c.bf16 ? 3e-2f : 4e-3f;
    bad = !(err <= tol);
    std::printf("%s %-28s max|err| = %.2e (tol %.0e)\n", bad ? "FAIL" : "ok  ", c.name, err, tol);
  }
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  static const int dims[] = {32, 64, 96, 128, 192, 256};
  int n = 0;
  for (int hd : dims)
    for (int bf : {0, 1})
      for (int causal : {0, 1})
        for (int split : {0, 1})
          if (mqa_byoc_fa2_kernel_available(hd, bf, causal, split)) {
            std::printf("linked: hdim%d %s%s%s\n", hd, bf ? "bf16" : "fp16", causal ? " causal" : "", split ? " split" : "");
            ++n;
          }
  std::printf("%d kernel families linked\n", n);
  if (argc < 2 || std::strcmp(argv[1], "--run") != 0) return 0;

  const Case cases[] = {
      {"prefill gqa causal fp16", 2, 128, 128, 8, 2, 128, 0, 1, -1, -1},
      {"prefill mqa causal bf16", 1, 200, 200, 8, 1, 128, 1, 1, -1, -1},
      {"decode gqa (swap, split)", 2, 1, 1000, 8, 2, 128, 0, 1, -1, -1},
      {"chunk gqa causal S_q<S_kv", 1, 16, 700, 4, 2, 64, 0, 1, -1, -1},
      {"window gqa fp16", 1, 64, 300, 4, 1, 64, 0, 1, 31, 0},
      {"noncausal gqa bf16", 2, 33, 77, 6, 3, 64, 1, 0, -1, -1},
      {"hdim 80 (kernel 96)", 1, 40, 40, 4, 2, 80, 0, 1, -1, -1},
  };
  int bad = 0;
  for (const Case& c : cases) bad += run_case(c);
  std::printf(bad ? "%d case(s) FAILED\n" : "all cases passed\n", bad);
  return bad ? 1 : 0;
}
