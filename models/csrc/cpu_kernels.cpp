// CPU kernels for the decode step (docs/design.md §13): paged attention that reads K/V pages
// where they lie, Mamba2's convolution and state update that read and write each state once,
// and RMS norm in one pass.
// Built on first use by models/cpu_kernels.py; every op checks its inputs and raises
// (a Python exception), never reads out of bounds.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

// One query per request. For each (request, KV head) the group's query heads score every
// visible slot, then take the softmax-weighted sum of the values. Slots past the query's
// position in its last block are added with weight 0, as the gathering path's mask does,
// so a NaN left in an allocated page still reaches the output (docs/design.md §1).
template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& table, const torch::Tensor& positions, double scale,
                           torch::Tensor& out) {
  const int64_t reqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, width = table.size(1);
  const int64_t kpage = k_cache.stride(0), kslot = k_cache.stride(1), khead = k_cache.stride(2);
  const int64_t vpage = v_cache.stride(0), vslot = v_cache.stride(1), vhead = v_cache.stride(2);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, reqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, kvh = task % kv_heads;
      const int64_t visible = pos_ptr[r] + 1;
      const int64_t blocks = (visible + block - 1) / block;
      const int64_t* row = table_ptr + r * width;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + (r * heads + kvh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(src[d]) * fscale;
      }
      scores.resize(group * visible);
      std::vector<float> top(group, -std::numeric_limits<float>::infinity());
      for (int64_t s = 0; s < visible; ++s) {
        const T* key = k_ptr + row[s / block] * kpage + (s % block) * kslot + kvh * khead;
        for (int64_t g = 0; g < group; ++g) {
          const float x = dot(qf.data() + g * dim, key, dim);
          scores[g * visible + s] = x;
          top[g] = std::max(top[g], x);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> total(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * visible;
        for (int64_t s = 0; s < visible; ++s) {
          sc[s] = std::exp(sc[s] - top[g]);
          total[g] += sc[s];
        }
      }
      for (int64_t s = 0; s < blocks * block; ++s) {
        const T* value = v_ptr + row[s / block] * vpage + (s % block) * vslot + kvh * vhead;
        for (int64_t g = 0; g < group; ++g)
          axpy(s < visible ? scores[g * visible + s] : 0.f, value, acc.data() + g * dim, dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out_ptr + (r * heads + kvh * group + g) * dim;
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

void check_pages(const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(cache.stride(3) == 1, name, "'s head_dim must be contiguous");
}

// Each new token's K and V into its slot (blocks[i], offsets[i]) of the pages: one call where
// two indexed assignments each took ~20 us at batch 1.
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& blocks, const torch::Tensor& offsets) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "CPU tensors only");
  check_pages(k_cache, "k_cache");
  check_pages(v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  const int64_t tokens = k.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == kv_heads && t->size(2) == dim &&
                    t->stride(2) == 1 && t->scalar_type() == k_cache.scalar_type() &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                "k and v must be [tokens, kv_heads, head_dim] in the caches' dtype");
  for (const auto* t : {&blocks, &offsets})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == tokens && t->scalar_type() == torch::kLong && t->is_contiguous(),
                "blocks and offsets must be contiguous int64 [tokens]");
  const int64_t* block_ptr = blocks.data_ptr<int64_t>();
  const int64_t* offset_ptr = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i)
    TORCH_CHECK(block_ptr[i] >= 0 && block_ptr[i] < k_cache.size(0) && offset_ptr[i] >= 0 &&
                    offset_ptr[i] < k_cache.size(1),
                "slot (", block_ptr[i], ", ", offset_ptr[i], ") is outside the cache");
  const size_t row_bytes = dim * k.element_size();
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  const int64_t item = k.element_size();
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t k_at = block_ptr[i] * k_cache.stride(0) + offset_ptr[i] * k_cache.stride(1) + h * k_cache.stride(2);
      const int64_t v_at = block_ptr[i] * v_cache.stride(0) + offset_ptr[i] * v_cache.stride(1) + h * v_cache.stride(2);
      std::memcpy(k_dst + k_at * item, k_src + (i * k.stride(0) + h * k.stride(1)) * item, row_bytes);
      std::memcpy(v_dst + v_at * item, v_src + (i * v.stride(0) + h * v.stride(1)) * item, row_bytes);
    }
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& table,
                                     const torch::Tensor& positions, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [requests, heads, head_dim]");
  check_pages(k_cache, "k_cache");
  check_pages(v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q's head_dim differs from the cache's");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == q.size(0) && table.scalar_type() == torch::kLong &&
                  table.is_contiguous(),
              "table must be a contiguous int64 [requests, blocks]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0) && positions.scalar_type() == torch::kLong &&
                  positions.is_contiguous(),
              "positions must be a contiguous int64 [requests]");
  const int64_t block = k_cache.size(1), num_blocks = k_cache.size(0), width = table.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* rows = table.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < width * block, "position ", pos[r], " of request ", r, " is outside its table");
    for (int64_t b = 0; b <= pos[r] / block; ++b)
      TORCH_CHECK(rows[r * width + b] >= 0 && rows[r * width + b] < num_blocks, "block ", rows[r * width + b],
                  " of request ", r, " is outside the cache");
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, table, positions, scale, out);
  });
  return out;
}

// The Mamba2 recurrence for one token of each request, in the request's state slot: one read
// and one write of each state. Per (request, head): step = max(softplus(dt + dt_bias), dt_min),
// S = exp(step * a) * S + (step * x) b^T, y = S c + d * x. b and c are per group of heads
// (h / (H / G)).
torch::Tensor mamba_ssm_step(torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& x,
                             const torch::Tensor& dt, const torch::Tensor& dt_bias, const torch::Tensor& a,
                             const torch::Tensor& d, const torch::Tensor& b, const torch::Tensor& c, double dt_min) {
  TORCH_CHECK(cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == torch::kFloat, "cache must be float32 [blocks, H, P, N]");
  const int64_t heads = cache.size(1), pdim = cache.size(2), nstate = cache.size(3);
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == nstate && cache.stride(1) == pdim * nstate,
              "each state slot must be contiguous");
  const int64_t reqs = slots.size(0);
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kLong && slots.is_contiguous(),
              "slots must be a contiguous int64 [requests]");
  for (const auto* t : {&x, &dt, &b, &c})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->size(0) == reqs,
                "x, dt, b and c must be contiguous float32 with one row per request");
  for (const auto* t : {&dt_bias, &a, &d})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 1 && t->size(0) == heads,
                "dt_bias, a and d must be contiguous float32 [H]");
  TORCH_CHECK(dt.dim() == 2 && dt.size(1) == heads, "dt must be [requests, H]");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == heads && x.size(2) == pdim, "x must be [requests, H, P]");
  TORCH_CHECK(b.dim() == 3 && b.sizes() == c.sizes() && b.size(2) == nstate && b.size(1) > 0 && heads % b.size(1) == 0,
              "b and c must be [requests, G, N] with G dividing H");
  const int64_t groups = b.size(1), per_group = heads / groups, page = cache.stride(0);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < reqs; ++r)
    TORCH_CHECK(slot_ptr[r] >= 0 && slot_ptr[r] < cache.size(0), "slot ", slot_ptr[r], " is outside the cache");
  auto y = torch::empty_like(x);
  float* state_ptr = cache.data_ptr<float>();
  const float *x_ptr = x.data_ptr<float>(), *dt_ptr = dt.data_ptr<float>();
  const float *bias_ptr = dt_bias.data_ptr<float>(), *a_ptr = a.data_ptr<float>(), *d_ptr = d.data_ptr<float>();
  const float *b_ptr = b.data_ptr<float>(), *c_ptr = c.data_ptr<float>();
  float* y_ptr = y.data_ptr<float>();
  const float fmin = static_cast<float>(dt_min);
  at::parallel_for(0, reqs * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads;
      const float raw = dt_ptr[task] + bias_ptr[h];
      const float step = std::max(raw > 20.f ? raw : std::log1p(std::exp(raw)), fmin);  // F.softplus
      const float decay = std::exp(step * a_ptr[h]);
      float* state = state_ptr + slot_ptr[r] * page + h * pdim * nstate;
      const float* bv = b_ptr + (r * groups + h / per_group) * nstate;
      const float* cv = c_ptr + (r * groups + h / per_group) * nstate;
      const float* xs = x_ptr + task * pdim;
      float* out = y_ptr + task * pdim;
      for (int64_t p = 0; p < pdim; ++p) {
        float* row = state + p * nstate;
        const float dx = step * xs[p];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < nstate; ++n) {
          row[n] = decay * row[n] + dx * bv[n];
          acc += row[n] * cv[n];
        }
        out[p] = acc + xs[p] * d_ptr[h];
      }
    }
  });
  return y;
}

// The causal depthwise convolution (Mamba2, Gated DeltaNet) for one token of each request:
// window = [state, x], out = silu(sum_k window[k] * weight[k] + bias), and the state keeps the
// window's last K - 1.
torch::Tensor causal_conv_step(torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& x,
                               const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(cache.device().is_cpu() && x.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == torch::kFloat, "cache must be float32 [blocks, C, K - 1]");
  const int64_t channels = cache.size(1), keep = cache.size(2), kernel = keep + 1;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 && x.size(1) == channels,
              "x must be float32 [requests, C] with C contiguous");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous() && weight.numel() == channels * kernel,
              "weight must be a contiguous float32 [C, 1, K]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == channels,
                "bias must be a contiguous float32 [C]");
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t reqs = x.size(0);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == reqs && slots.scalar_type() == torch::kLong && slots.is_contiguous(),
              "slots must be a contiguous int64 [requests]");
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < reqs; ++r)
    TORCH_CHECK(slot_ptr[r] >= 0 && slot_ptr[r] < cache.size(0), "slot ", slot_ptr[r], " is outside the cache");
  auto out = torch::empty({reqs, channels}, x.options());
  float* state_ptr = cache.data_ptr<float>();
  const float *x_ptr = x.data_ptr<float>(), *w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t page = cache.stride(0), cstride = cache.stride(1), kstride = cache.stride(2);
  const int64_t xrow = x.stride(0);
  at::parallel_for(0, reqs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* state = state_ptr + slot_ptr[r] * page;
      for (int64_t ch = 0; ch < channels; ++ch) {
        float* st = state + ch * cstride;
        const float* w = w_ptr + ch * kernel;
        const float xin = x_ptr[r * xrow + ch];
        float acc = 0.f;
        for (int64_t k = 0; k < keep; ++k) acc += st[k * kstride] * w[k];
        acc += xin * w[keep];
        if (bias_ptr != nullptr) acc += bias_ptr[ch];
        for (int64_t k = 0; k + 1 < keep; ++k) st[k * kstride] = st[(k + 1) * kstride];
        st[(keep - 1) * kstride] = xin;
        out_ptr[r * channels + ch] = acc / (1.f + std::exp(-acc));  // silu
      }
    }
  });
  return out;
}

// x * rsqrt(mean(x^2) + eps) [* weight] over the last dim of a [rows, D] or [A, B, D] fp32
// tensor whose rows may be strided (a slice of a stacked projection): one pass to sum the
// squares and one to scale, where the composite op took seven calls.
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat, "x must be a float32 CPU tensor");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "x must be [rows, D] or [A, B, D], D contiguous");
  const int64_t dim = x.size(-1), inner = x.size(-2), outer = x.dim() == 3 ? x.size(0) : 1;
  const int64_t outer_stride = x.dim() == 3 ? x.stride(0) : 0, inner_stride = x.stride(-2);
  const float* w = nullptr;
  if (weight.has_value()) {
    TORCH_CHECK(weight->scalar_type() == torch::kFloat && weight->is_contiguous() && weight->numel() == dim,
                "weight must be a contiguous float32 [D]");
    w = weight->data_ptr<float>();
  }
  auto out = torch::empty(x.sizes(), x.options());
  const float* x_ptr = x.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, outer * inner, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* src = x_ptr + (row / inner) * outer_stride + (row % inner) * inner_stride;
      float* dst = out_ptr + row * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += src[i] * src[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + feps);
      if (w != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) dst[i] = src[i] * inv * w[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) dst[i] = src[i] * inv;
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("write_kv", &write_kv);
  m.def("mamba_ssm_step", &mamba_ssm_step);
  m.def("causal_conv_step", &causal_conv_step);
  m.def("rms_norm", &rms_norm);
}
