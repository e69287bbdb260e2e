// CPU kernels (docs/design.md §13): paged decode attention that reads K/V pages where they lie,
// Mamba2's convolution and recurrence over every request's tokens of a step, reading and
// writing each state once, RMS norm in one pass, a few rows' matmul against oneDNN's packed
// weights, and a mixture's experts run side by side.
// Built on first use by kernels/cpu/ops.py; every op checks its inputs and raises
// (a Python exception), never reads out of bounds.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>

#ifdef __linux__
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

namespace {

// Eight floats as one value (GCC's and clang's vector extension, lowered to whatever vector
// registers the target has): the scan's running sums stay in registers, where an `omp simd`
// reduction over four of them kept its partial sums in memory.
constexpr int64_t kLanes = 8;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// Any vector type V (Lanes here; the panel kernel's AVX-512 functions also load `Wide`). Always
// inlined, so that each caller builds it for its own vector width.
template <typename V = Lanes>
__attribute__((always_inline)) inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
__attribute__((always_inline)) inline void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

typedef float HalfLanes __attribute__((vector_size(kLanes / 2 * sizeof(float))));

// The halves added as vectors first: lane by lane it took 8 extracts and 7 adds per sum.
inline float sum(Lanes v) {
  HalfLanes lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const HalfLanes h = lo + hi;
  return (h[0] + h[2]) + (h[1] + h[3]);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

// fp32 keys of a width the vector divides (a head is 64 or 128 wide): the sum in registers.
template <>
inline float dot<float>(const float* q, const float* k, int64_t n) {
  if (n % kLanes != 0) {
    float acc = 0.f;
    for (int64_t i = 0; i < n; ++i) acc += q[i] * k[i];
    return acc;
  }
  Lanes acc = {};
  for (int64_t i = 0; i < n; i += kLanes) acc += load(q + i) * load(k + i);
  return sum(acc);
}

typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

// floor(t) as a float, and as the int32 it is, for one float or eight lanes. GCC leaves
// std::floor and a float-to-int cast unvectorised inside `omp simd` loops, so the lanes'
// form is the truncation corrected where it rounded up (t is clamped far inside int32).
inline float floor_parts(float t, int32_t& whole) {
  const float k = std::floor(t);
  whole = static_cast<int32_t>(k);
  return k;
}

inline Lanes floor_parts(Lanes t, IntLanes& whole) {
  whole = __builtin_convertvector(t, IntLanes);
  whole += __builtin_convertvector(whole, Lanes) > t;  // -1 where truncation rounded up
  return __builtin_convertvector(whole, Lanes);
}

// exp(x) as a polynomial on a range-reduced argument (Cephes' expf, within 2 ulp of std::exp),
// for one float (F, I = float, int32_t) or eight lanes at once (Lanes, IntLanes), the same
// steps either way, so both give the same bits; libm's expf is one call per element. The
// lanes' form is what a silu over a prefill's activations needs: the scalar one in an `omp
// simd` loop stayed a lane at a time (0.8 ms for 128 x 2048 against torch's 0.05). The
// clamps' compares are selects given -fno-trapping-math. A NaN stays NaN.
template <typename F, typename I>
inline F exp_of(F x) {
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  I whole;
  const F k = floor_parts(x * 1.44269504088896341f + 0.5f, whole);  // x / ln 2, rounded
  const F r = x - k * 0.693359375f + k * 2.12194440e-4f;          // x - k ln 2, in two parts
  F p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I bits = (whole + 127) << 23;  // 2^k
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float exp_poly(float x) { return exp_of<float, int32_t>(x); }

// out[i] = silu(g[i]) * (m ? m[i] : 1) for n floats; out may be g.
inline void silu_times(const float* g, const float* m, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes v = load(g + i);
    Lanes y = v / (1.f + exp_of<Lanes, IntLanes>(-v));
    if (m != nullptr) y *= load(m + i);
    store(out + i, y);
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + exp_poly(-g[i])) * (m != nullptr ? m[i] : 1.f);
}

// A head's row of a K or V page, asked of memory ahead of its use. A (request, KV head) task
// reads `dim` values from each slot, a slot's heads apart: with 8 heads of 128 fp32 that is a
// 4 KiB stride, past which the hardware prefetcher does not follow, so without these every
// row was a demand miss and decode attention ran at a third of the bandwidth.
template <typename T>
inline void prefetch_row(const T* p, int64_t dim) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

constexpr int64_t kAhead = 4;  // slots between a row's prefetch and its use

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
        if (s + kAhead < visible) {
          const int64_t a = s + kAhead;
          prefetch_row(k_ptr + row[a / block] * kpage + (a % block) * kslot + kvh * khead, dim);
        }
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
        const float shift = top[g];
        float sum_g = 0.f;
#pragma omp simd reduction(+ : sum_g)
        for (int64_t s = 0; s < visible; ++s) {
          sc[s] = exp_poly(sc[s] - shift);
          sum_g += sc[s];
        }
        total[g] = sum_g;
      }
      for (int64_t s = 0; s < blocks * block; ++s) {
        if (s + kAhead < blocks * block) {
          const int64_t a = s + kAhead;
          prefetch_row(v_ptr + row[a / block] * vpage + (a % block) * vslot + kvh * vhead, dim);
        }
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

// The first `count` blocks of request r's table row, the ones a kernel reads, all in the cache.
void check_blocks(const int64_t* row, int64_t count, int64_t num_blocks, int64_t r) {
  for (int64_t b = 0; b < count; ++b)
    TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, "block ", row[b], " of request ", r, " is outside the cache");
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
    check_blocks(rows + r * width, pos[r] / block + 1, num_blocks, r);
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, table, positions, scale, out);
  });
  return out;
}

// Which tokens of the flat batch each request owns, and whether it starts from an empty
// state. Without `starts` each request has one token (a decode step); without `fresh` every
// request continues the state in its slot.
struct Spans {
  std::vector<int64_t> starts;
  std::vector<bool> fresh;
};

Spans read_spans(const c10::optional<torch::Tensor>& starts, const c10::optional<torch::Tensor>& fresh, int64_t reqs,
                 int64_t tokens) {
  Spans spans;
  spans.starts.resize(reqs + 1);
  if (starts.has_value()) {
    TORCH_CHECK(starts->dim() == 1 && starts->size(0) == reqs + 1 && starts->scalar_type() == torch::kLong &&
                    starts->is_contiguous(),
                "starts must be a contiguous int64 [requests + 1]");
    const int64_t* p = starts->data_ptr<int64_t>();
    TORCH_CHECK(p[0] == 0 && p[reqs] == tokens, "starts must run from 0 to the number of tokens");
    for (int64_t r = 0; r <= reqs; ++r) {
      TORCH_CHECK(r == 0 || p[r] > p[r - 1], "starts must increase: every request has a token");
      spans.starts[r] = p[r];
    }
  } else {
    TORCH_CHECK(tokens == reqs, "without starts there is one token per request");
    for (int64_t r = 0; r <= reqs; ++r) spans.starts[r] = r;
  }
  spans.fresh.assign(reqs, false);
  if (fresh.has_value()) {
    TORCH_CHECK(fresh->dim() == 1 && fresh->size(0) == reqs && fresh->scalar_type() == torch::kBool &&
                    fresh->is_contiguous(),
                "fresh must be a contiguous bool [requests]");
    const bool* f = fresh->data_ptr<bool>();
    for (int64_t r = 0; r < reqs; ++r) spans.fresh[r] = f[r];
  }
  return spans;
}

void check_slots(const torch::Tensor& slots, int64_t reqs, int64_t blocks) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == reqs && slots.scalar_type() == torch::kLong && slots.is_contiguous(),
              "slots must be a contiguous int64 [requests]");
  const int64_t* p = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < reqs; ++r) TORCH_CHECK(p[r] >= 0 && p[r] < blocks, "slot ", p[r], " is outside the cache");
}

// One token of one head of the Mamba2 recurrence: its decay and step, and where its b, c and x
// are read and its y written.
struct SsmToken {
  float decay, step;
  const float *b, *c, *x;
  float* y;
};

constexpr int64_t kSsmTokens = 4;

// Advance one head's state [P, N] by `count` (<= kSsmTokens) consecutive tokens. Each state row
// takes all of them in one pass while it is in registers: a row per token would load and
// store the state once per token, and those loads, not the flops, bounded the scan.
template <int64_t M>
inline void ssm_advance_lanes(float* state, int64_t pdim, int64_t nstate, const SsmToken* tok, float d) {
  for (int64_t p = 0; p < pdim; ++p) {
    float* row = state + p * nstate;
    float dx[M], decay[M];
    const float *b[M], *c[M];
    Lanes acc[M];
#pragma GCC unroll 16
    for (int64_t m = 0; m < M; ++m) {
      dx[m] = tok[m].step * tok[m].x[p];
      decay[m] = tok[m].decay;
      b[m] = tok[m].b;
      c[m] = tok[m].c;
      acc[m] = Lanes{};
    }
    for (int64_t n = 0; n < nstate; n += kLanes) {
      Lanes v = load(row + n);
#pragma GCC unroll 16
      for (int64_t m = 0; m < M; ++m) {
        v = decay[m] * v + dx[m] * load(b[m] + n);
        acc[m] += v * load(c[m] + n);
      }
      store(row + n, v);
    }
#pragma GCC unroll 16
    for (int64_t m = 0; m < M; ++m) tok[m].y[p] = sum(acc[m]) + tok[m].x[p] * d;
  }
}

inline void ssm_advance(float* state, int64_t pdim, int64_t nstate, const SsmToken* tok, int64_t count, float d) {
  if (nstate % kLanes == 0) {
    if (count == kSsmTokens) {
      ssm_advance_lanes<kSsmTokens>(state, pdim, nstate, tok, d);
    } else {
      for (int64_t i = 0; i < count; ++i) ssm_advance_lanes<1>(state, pdim, nstate, tok + i, d);
    }
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    const float decay = tok[i].decay, step = tok[i].step;
    const float *b = tok[i].b, *c = tok[i].c, *x = tok[i].x;
    for (int64_t p = 0; p < pdim; ++p) {
      float* row = state + p * nstate;
      const float dx = step * x[p];
      float acc = 0.f;
      for (int64_t n = 0; n < nstate; ++n) {
        row[n] = decay * row[n] + dx * b[n];
        acc += row[n] * c[n];
      }
      tok[i].y[p] = acc + x[p] * d;
    }
  }
}

// The Mamba2 recurrence over each request's tokens in turn, in the request's state slot: the
// state stays in cache while its tokens stream past it, and is read and written once. Per
// (request, head) and token: step = max(softplus(dt + dt_bias), dt_min), S = exp(step * a) * S +
// (step * x) b^T, y = S c + d * x. b and c are per group of heads (h / (H / G)). A fresh request
// starts from zeros without reading its slot (docs/design.md §1: Mamba pages are never zeroed).
// Prefill runs the same recurrence as decode: on a CPU it does as few flops per token as the
// chunked scan and keeps no [T, T] intermediates.
torch::Tensor mamba_ssm_scan(torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& x,
                             const torch::Tensor& dt, const torch::Tensor& dt_bias, const torch::Tensor& a,
                             const torch::Tensor& d, const torch::Tensor& b, const torch::Tensor& c, double dt_min,
                             const c10::optional<torch::Tensor>& starts, const c10::optional<torch::Tensor>& fresh) {
  TORCH_CHECK(cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == torch::kFloat, "cache must be float32 [blocks, H, P, N]");
  const int64_t heads = cache.size(1), pdim = cache.size(2), nstate = cache.size(3);
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == nstate && cache.stride(1) == pdim * nstate,
              "each state slot must be contiguous");
  const int64_t reqs = slots.size(0), tokens = x.size(0);
  check_slots(slots, reqs, cache.size(0));
  for (const auto* t : {&x, &dt, &b, &c})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->size(0) == tokens,
                "x, dt, b and c must be contiguous float32 with one row per token");
  for (const auto* t : {&dt_bias, &a, &d})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 1 && t->size(0) == heads,
                "dt_bias, a and d must be contiguous float32 [H]");
  TORCH_CHECK(dt.dim() == 2 && dt.size(1) == heads, "dt must be [tokens, H]");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == heads && x.size(2) == pdim, "x must be [tokens, H, P]");
  TORCH_CHECK(b.dim() == 3 && b.sizes() == c.sizes() && b.size(2) == nstate && b.size(1) > 0 && heads % b.size(1) == 0,
              "b and c must be [tokens, G, N] with G dividing H");
  const Spans spans = read_spans(starts, fresh, reqs, tokens);
  const int64_t groups = b.size(1), per_group = heads / groups, page = cache.stride(0);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  auto y = torch::empty_like(x);
  float* state_ptr = cache.data_ptr<float>();
  const float *x_ptr = x.data_ptr<float>(), *dt_ptr = dt.data_ptr<float>();
  const float *bias_ptr = dt_bias.data_ptr<float>(), *a_ptr = a.data_ptr<float>(), *d_ptr = d.data_ptr<float>();
  const float *b_ptr = b.data_ptr<float>(), *c_ptr = c.data_ptr<float>();
  float* y_ptr = y.data_ptr<float>();
  const float fmin = static_cast<float>(dt_min);
  at::parallel_for(0, reqs * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads, g = h / per_group;
      float* state = state_ptr + slot_ptr[r] * page + h * pdim * nstate;
      if (spans.fresh[r]) std::fill(state, state + pdim * nstate, 0.f);
      SsmToken batch[kSsmTokens];
      int64_t held = 0;
      for (int64_t t = spans.starts[r]; t < spans.starts[r + 1]; ++t) {
        const float raw = dt_ptr[t * heads + h] + bias_ptr[h];
        const float step = std::max(raw > 20.f ? raw : std::log1p(std::exp(raw)), fmin);  // F.softplus
        batch[held++] = {std::exp(step * a_ptr[h]), step, b_ptr + (t * groups + g) * nstate,
                         c_ptr + (t * groups + g) * nstate, x_ptr + (t * heads + h) * pdim,
                         y_ptr + (t * heads + h) * pdim};
        if (held == kSsmTokens || t + 1 == spans.starts[r + 1]) {
          ssm_advance(state, pdim, nstate, batch, held, d_ptr[h]);
          held = 0;
        }
      }
    }
  });
  return y;
}

// Channels of one causal_conv task: a prefill of a single request is split across the threads
// by channels (the whole row per token made it one thread's, and its output row and K input
// rows, ~100 KB at a real model's 6144 channels, spilled out of L1: 3.9 ms a 128-token chunk,
// now a tenth of that), and a block's accumulators and inputs stay in L1 across its taps.
constexpr int64_t kConvChannels = 512;

// The causal depthwise convolution (Mamba2, Gated DeltaNet) over each request's tokens,
// continuing from the state in its slot (zeros for a fresh request, whose slot is not read):
// out[t] = silu(sum_k input[t - K + 1 + k] * weight[k] + bias), where inputs before the
// request's first token come from the state, and the state keeps the last K - 1 inputs.
// Each channel is independent: tasks are (request, block of channels), the arithmetic per
// element the same whatever the split.
torch::Tensor causal_conv(torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& x,
                          const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& starts, const c10::optional<torch::Tensor>& fresh) {
  TORCH_CHECK(cache.device().is_cpu() && x.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == torch::kFloat, "cache must be float32 [blocks, C, K - 1]");
  const int64_t channels = cache.size(1), keep = cache.size(2), kernel = keep + 1;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 && x.size(1) == channels,
              "x must be float32 [tokens, C] with C contiguous");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous() && weight.numel() == channels * kernel,
              "weight must be a contiguous float32 [C, 1, K]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == channels,
                "bias must be a contiguous float32 [C]");
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t reqs = slots.size(0), tokens = x.size(0);
  check_slots(slots, reqs, cache.size(0));
  const Spans spans = read_spans(starts, fresh, reqs, tokens);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  auto out = torch::empty({tokens, channels}, x.options());
  // The taps laid out [K, C]: a token's channels then read each tap contiguously.
  std::vector<float> taps(kernel * channels);
  const float* w_ptr = weight.data_ptr<float>();
  for (int64_t ch = 0; ch < channels; ++ch)
    for (int64_t k = 0; k < kernel; ++k) taps[k * channels + ch] = w_ptr[ch * kernel + k];
  float* state_ptr = cache.data_ptr<float>();
  const float* x_ptr = x.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t page = cache.stride(0), cstride = cache.stride(1), kstride = cache.stride(2);
  const int64_t xrow = x.stride(0);
  const int64_t blocks = (channels + kConvChannels - 1) / kConvChannels;
  at::parallel_for(0, reqs * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / blocks, c0 = (task % blocks) * kConvChannels;
      const int64_t width = std::min(kConvChannels, channels - c0);
      float* state = state_ptr + slot_ptr[r] * page + c0 * cstride;
      const int64_t lo = spans.starts[r], hi = spans.starts[r + 1];
      const bool zero = spans.fresh[r];
      for (int64_t t = lo; t < hi; ++t) {
        float* acc = out_ptr + t * channels + c0;
        if (bias_ptr != nullptr)
          std::copy(bias_ptr + c0, bias_ptr + c0 + width, acc);
        else
          std::fill(acc, acc + width, 0.f);
        for (int64_t k = 0; k < kernel; ++k) {
          const int64_t src = t - keep + k;  // the input this tap reads
          const float* w = taps.data() + k * channels + c0;
          if (src >= lo) {
            const float* in = x_ptr + src * xrow + c0;
#pragma omp simd
            for (int64_t ch = 0; ch < width; ++ch) acc[ch] += w[ch] * in[ch];
          } else if (!zero) {
            const float* st = state + (keep - (lo - src)) * kstride;
            for (int64_t ch = 0; ch < width; ++ch) acc[ch] += w[ch] * st[ch * cstride];
          }
        }
        silu_times(acc, nullptr, acc, width);
      }
      // The state keeps inputs hi - K + 1 .. hi - 1. Slot j takes old slot j + (hi - lo) where
      // that input came before this request's tokens: a later slot, not yet overwritten.
      for (int64_t j = 0; j < keep; ++j) {
        const int64_t src = hi - keep + j;
        for (int64_t ch = 0; ch < width; ++ch) {
          float* st = state + ch * cstride;
          st[j * kstride] = src >= lo ? x_ptr[src * xrow + c0 + ch] : (zero ? 0.f : st[(j + hi - lo) * kstride]);
        }
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

// Mamba2's output norm in one pass per row: h = x * silu(gate), then each group of `group`
// channels RMS-normalised and scaled by its weight. x and gate are [rows, D] with their rows
// strided (gate is a slice of the input projection); torch took five calls, each a pass over a
// prefill's [tokens, D] activations.
torch::Tensor gated_rms_norm(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& weight,
                             int64_t group, double eps) {
  TORCH_CHECK(x.device().is_cpu() && gate.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "x must be float32 [rows, D]");
  TORCH_CHECK(gate.sizes() == x.sizes() && gate.scalar_type() == torch::kFloat && gate.stride(1) == 1,
              "gate must be float32 and shaped as x");
  const int64_t rows = x.size(0), dim = x.size(1);
  TORCH_CHECK(group > 0 && dim % group == 0, "the group size must divide the row");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous() && weight.numel() == dim,
              "weight must be a contiguous float32 [D]");
  auto out = torch::empty({rows, dim}, x.options());
  const float *x_ptr = x.data_ptr<float>(), *g_ptr = gate.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t xrow = x.stride(0), grow = gate.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float *src = x_ptr + row * xrow, *gv = g_ptr + row * grow;
      float* dst = out_ptr + row * dim;
      silu_times(gv, src, dst, dim);
      for (int64_t lo = 0; lo < dim; lo += group) {
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = lo; i < lo + group; ++i) squares += dst[i] * dst[i];
        const float inv = 1.f / std::sqrt(squares / static_cast<float>(group) + feps);
#pragma omp simd
        for (int64_t i = lo; i < lo + group; ++i) dst[i] = dst[i] * inv * w[i];
      }
    }
  });
  return out;
}

// Qwen3's q and k heads as attention reads them, in one pass per head: RMS-normalised as
// rms_norm does it, times the head's norm weight, then rotated by the rotary table (rotate-half:
// x * cos + roll(x, D / 2) * sin, the sin signed on the first half, models/layers.Rotary). torch
// took five passes over a prefill's [tokens, heads, D] (the norm, the weight, roll's copy, two
// products and their sum): ~2 ms a layer of a real-size 128-token prefill, a tenth of its time
// outside the matmuls. Each product and the sum are rounded on their own (no fused
// multiply-add), so the result is torch's bit for bit. x: [T, Hqk, D] with D contiguous (a slice
// of the stacked qkv projection); weight [Hqk, D]; cos and sin [T, D]. Returns [T, Hqk, D].
constexpr int64_t kMaxRotaryDim = 1024;

// The rotation of one normalised head. Its own function, built without contracting a product
// and a sum into a fused multiply-add (which the rest of the file may do: the norm's sum of
// squares must contract as rms_norm's does), and so never inlined into its caller.
__attribute__((optimize("fp-contract=off"), noinline)) void rotate_half(const float* x, const float* cs,
                                                                        const float* sn, int64_t dim, float* out) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cs[i] + x[i + half] * sn[i];
#pragma omp simd
  for (int64_t i = half; i < dim; ++i) out[i] = x[i] * cs[i] + x[i - half] * sn[i];
}

torch::Tensor qk_norm_rope(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& cos,
                           const torch::Tensor& sin, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "x must be a float32 CPU [tokens, heads, D] with D contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0 && dim <= kMaxRotaryDim, "the head dim must be even and at most ", kMaxRotaryDim);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(0) == heads && weight.size(1) == dim,
              "weight must be a contiguous float32 [heads, D]");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == tokens &&
                    t->size(1) == dim,
                "cos and sin must be contiguous float32 [tokens, D]");
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const float *x_ptr = x.data_ptr<float>(), *w_ptr = weight.data_ptr<float>();
  const float *cos_ptr = cos.data_ptr<float>(), *sin_ptr = sin.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t tstride = x.stride(0), hstride = x.stride(1);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, tokens * heads, 16, [&](int64_t begin, int64_t end) {
    float normed[kMaxRotaryDim];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      const float* src = x_ptr + t * tstride + h * hstride;
      const float *w = w_ptr + h * dim, *cs = cos_ptr + t * dim, *sn = sin_ptr + t * dim;
      float* dst = out_ptr + row * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += src[i] * src[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + feps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) normed[i] = src[i] * inv * w[i];
      rotate_half(normed, cs, sn, dim, dst);
    }
  });
  return out;
}

// A matmul of a few rows (a decode step's tokens) against a weight in oneDNN's packed layout,
// read where oneDNN keeps it: `panels` [blocks, kp, nb] holds output columns b*nb.. of block b
// as [k][column], k padded to kp. At a few rows the weight streams from memory once and the
// arithmetic is small: oneDNN read it at 15-19 GB/s and spent ~15 us a call before it started,
// where a pass along each block's rows, in order, reads at the ~30 GB/s a core gets here.
// Each block is taken in chunks of k that fit L1. Every pass reads whole rows of the block, so
// the first one over a chunk streams it in the order the hardware prefetcher follows (passes
// of 16 columns each, or explicit prefetches, ran at a third to half the speed). With AVX-512
// (32 vector registers) up to six x rows share each pass, their sums for a whole 64-column row
// in registers, and the arithmetic overlaps the stream. With AVX2 (16 registers) one row's
// sums for a 64-column row fill half of them: the first row streams the chunk alone, and the
// others follow from L1 in groups of up to three over half rows (panel_chunk_avx2).
constexpr int64_t kPanelChunk = 64;

// Sixteen floats: one AVX-512 register in the functions built for it.
typedef float Wide __attribute__((vector_size(16 * sizeof(float))));

// G rows of x against S vectors of columns of a block's k rows k0..k1 (`wld` floats apart: a
// whole block row where S * width is the block's width, a slice of it otherwise), their sums
// carried in `acc` (G rows, `ld` apart) from chunk to chunk. Inlined into each caller, so that
// it is built for the caller's vector width.
template <typename V, int G, int S>
__attribute__((always_inline)) inline void panel_pass(const float* x, int64_t ldx, const float* w, int64_t wld,
                                                      int64_t k0, int64_t k1, float* acc, int64_t ld, bool first) {
  constexpr int64_t width = sizeof(V) / sizeof(float);
  V sums[G][S];
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < S; ++s) sums[g][s] = first ? V{} : load<V>(acc + g * ld + s * width);
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = w + k * wld;
    V wv[S];
    for (int s = 0; s < S; ++s) wv[s] = load<V>(row + s * width);
    for (int g = 0; g < G; ++g) {
      const float xv = x[g * ldx + k];
      for (int s = 0; s < S; ++s) sums[g][s] += xv * wv[s];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < S; ++s) store(acc + g * ld + s * width, sums[g][s]);
}

// One row over whole block rows: the pass that streams a chunk from memory.
void panel_row_avx2(const float* x, const float* block, int64_t nb, int64_t k0, int64_t k1, float* acc, bool first) {
  switch (nb) {
    case 16: panel_pass<Lanes, 1, 2>(x, 0, block, nb, k0, k1, acc, nb, first); break;
    case 32: panel_pass<Lanes, 1, 4>(x, 0, block, nb, k0, k1, acc, nb, first); break;
    case 48: panel_pass<Lanes, 1, 6>(x, 0, block, nb, k0, k1, acc, nb, first); break;
    default: panel_pass<Lanes, 1, 8>(x, 0, block, nb, k0, k1, acc, nb, first); break;
  }
}

// G (1-3) rows against a slice of S vectors (S * 8 columns) of each block row, from L1.
template <int S>
void panel_slice_avx2(const float* x, int64_t ldx, int64_t group, const float* w, int64_t nb, int64_t k0, int64_t k1,
                      float* acc, bool first) {
  switch (group) {
    case 1: panel_pass<Lanes, 1, S>(x, ldx, w, nb, k0, k1, acc, nb, first); break;
    case 2: panel_pass<Lanes, 2, S>(x, ldx, w, nb, k0, k1, acc, nb, first); break;
    default: panel_pass<Lanes, 3, S>(x, ldx, w, nb, k0, k1, acc, nb, first); break;
  }
}

// The first row streams the chunk from memory over whole block rows; the rest share its reads
// from L1 in groups of up to three, over slices of at most 32 columns, so that a group's sums
// (twelve) and the broadcast x fit AVX2's 16 registers, the weights taken as FMA memory
// operands. Row by row (eight sums each) the arithmetic waited on one row's sums.
void panel_chunk_avx2(const float* x, int64_t ldx, int64_t rows, const float* block, int64_t nb, int64_t k0,
                      int64_t k1, float* acc, bool first) {
  panel_row_avx2(x, block, nb, k0, k1, acc, first);
  const int64_t slice = nb <= 32 ? nb : nb / 2;
  for (int64_t r = 1; r < rows;) {
    const int64_t left = rows - r, groups = (left + 2) / 3, group = (left + groups - 1) / groups;
    const float* xr = x + r * ldx;
    if (group == 1) {  // a lone row keeps its eight sums: four chains of FMAs wait on their latency
      panel_row_avx2(xr, block, nb, k0, k1, acc + r * nb, first);
      r += 1;
      continue;
    }
    for (int64_t c = 0; c < nb; c += slice) {
      float* ar = acc + r * nb + c;
      switch (slice) {
        case 16: panel_slice_avx2<2>(xr, ldx, group, block + c, nb, k0, k1, ar, first); break;
        case 24: panel_slice_avx2<3>(xr, ldx, group, block + c, nb, k0, k1, ar, first); break;
        default: panel_slice_avx2<4>(xr, ldx, group, block + c, nb, k0, k1, ar, first); break;
      }
    }
    r += group;
  }
}

template <int G>
__attribute__((target("avx512f"))) void panel_group_avx512(const float* x, int64_t ldx, const float* block,
                                                            int64_t nb, int64_t k0, int64_t k1, float* acc,
                                                            bool first) {
  switch (nb) {
    case 16: panel_pass<Wide, G, 1>(x, ldx, block, nb, k0, k1, acc, nb, first); break;
    case 32: panel_pass<Wide, G, 2>(x, ldx, block, nb, k0, k1, acc, nb, first); break;
    case 48: panel_pass<Wide, G, 3>(x, ldx, block, nb, k0, k1, acc, nb, first); break;
    default: panel_pass<Wide, G, 4>(x, ldx, block, nb, k0, k1, acc, nb, first); break;
  }
}

// Groups of two to six rows; seven to twelve rows split into two even groups. A lone row takes
// the 8-float pass: eight sums for a 64-column row, where four 16-float sums ran 10-20% slower.
void panel_chunk_avx512(const float* x, int64_t ldx, int64_t rows, const float* block, int64_t nb, int64_t k0,
                        int64_t k1, float* acc, bool first) {
  for (int64_t r = 0; r < rows;) {
    const int64_t left = rows - r, group = left <= 6 ? left : (left <= 12 ? (left + 1) / 2 : 6);
    const float* xr = x + r * ldx;
    float* ar = acc + r * nb;
    switch (group) {
      case 1: panel_row_avx2(xr, block, nb, k0, k1, ar, first); break;
      case 2: panel_group_avx512<2>(xr, ldx, block, nb, k0, k1, ar, first); break;
      case 3: panel_group_avx512<3>(xr, ldx, block, nb, k0, k1, ar, first); break;
      case 4: panel_group_avx512<4>(xr, ldx, block, nb, k0, k1, ar, first); break;
      case 5: panel_group_avx512<5>(xr, ldx, block, nb, k0, k1, ar, first); break;
      default: panel_group_avx512<6>(xr, ldx, block, nb, k0, k1, ar, first); break;
    }
    r += group;
  }
}

bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// The vector width panel_linear uses on this CPU (512 or 256 bits), for Python to pick its
// row limit by.
int64_t panel_vector_bits() { return has_avx512() ? 512 : 256; }

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias,
                           int64_t out_features, int64_t vector_bits) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "x must be float32 [rows, in_features] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kFloat && panels.is_contiguous(),
              "panels must be a contiguous float32 [blocks, kp, nb]");
  const int64_t rows = x.size(0), k_len = x.size(1), blocks = panels.size(0), kp = panels.size(1), nb = panels.size(2);
  TORCH_CHECK(nb == 16 || nb == 32 || nb == 48 || nb == 64, "a panel block is 16, 32, 48 or 64 columns, not ", nb);
  TORCH_CHECK(k_len <= kp, "x has ", k_len, " features and the panels ", kp);
  TORCH_CHECK(vector_bits == 256 || (vector_bits == 512 && has_avx512()), vector_bits,
              "-bit vectors are not available on this CPU");
  const auto chunk = vector_bits == 512 ? panel_chunk_avx512 : panel_chunk_avx2;
  TORCH_CHECK(out_features > (blocks - 1) * nb && out_features <= blocks * nb, out_features,
              " output features do not fill ", blocks, " blocks of ", nb);
  const float* b_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == out_features,
                "bias must be a contiguous float32 [out_features]");
    b_ptr = bias->data_ptr<float>();
  }
  auto out = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const float *x_ptr = x.data_ptr<float>(), *w_ptr = panels.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Blocks are handed out one at a time from a shared counter rather than split into one
  // fixed range a thread: a thread that the OS preempts (the server's other processes share
  // these cores) leaves its blocks to the others instead of holding up the whole call. A
  // thread joins for every 256 KB of weight, so a small weight runs on the caller alone.
  const int64_t per_thread = std::max<int64_t>(1, (int64_t{1} << 16) / (kp * nb));
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (blocks + per_thread - 1) / per_thread);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> acc(rows * nb);
    for (int64_t b = next.fetch_add(1, std::memory_order_relaxed); b < blocks;
         b = next.fetch_add(1, std::memory_order_relaxed)) {
      const float* block = w_ptr + b * kp * nb;
      for (int64_t k0 = 0; k0 < k_len; k0 += kPanelChunk)
        chunk(x_ptr, ldx, rows, block, nb, k0, std::min(k_len, k0 + kPanelChunk), acc.data(), k0 == 0);
      if (k_len == 0) std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t cols = std::min(nb, out_features - b * nb);
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out_ptr + r * out_features + b * nb;
        const float* src = acc.data() + r * nb;
        if (b_ptr != nullptr) {
          for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + b_ptr[b * nb + c];
        } else {
          std::memcpy(dst, src, cols * sizeof(float));
        }
      }
    }
  });
  return out;
}

// Causal attention of a step's prompt chunks, flash-style, each read from its request's pages:
// per (request, KV head, block of queries) task, the group's query heads' rows score a block of
// keys at a time, a running max and sum per row keep the softmax exact, and the rows' outputs
// gather the values block by block; no [T, T] scores. torch's SDPA does the same with MKL's sgemm
// on small tiles, and on an AMD CPU MKL runs its AVX2 kernels whatever the CPU has (77% of
// SDPA's samples at 1024 tokens here in `mkl_blas_def_sgemm_kernel_0_zen`), at 67-130 GFLOP/s on
// two cores; with a mask (a chunk after cached tokens) it also computes every key tile it then
// masks out. Here both products are panel_linear's register-blocked pass (`panel_pass`) at the
// CPU's own width. A chunk's query at position p sees its request's keys 0..p, whether earlier
// chunks were computed in this step or before. The last query block of a chunk reads every slot
// up to the end of its last page: a slot past the chunk enters the values' sum with weight 0, so
// a NaN left there reaches the output (docs/design.md §1), as through SDPA's tile over it.

// Row m of a block's scores `s` (`keys` of them real, the first `visible` seen by its query),
// scaled, turned into the block's probabilities against the row's running max, which moves
// to take them in: the row's output and sum are rescaled to the new max. Probabilities of
// keys the query does not see are 0.
inline void attn_softmax(float* s, int64_t block, int64_t visible, float scale, float& max, float& sum, float* o,
                         int64_t dim) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < visible; ++j) {
    s[j] *= scale;
    best = std::max(best, s[j]);
  }
  const float next = std::max(max, best);
  if (visible > 0 && next != max) {
    const float shrink = max == -std::numeric_limits<float>::infinity() ? 0.f : exp_poly(max - next);
    for (int64_t d = 0; d < dim; ++d) o[d] *= shrink;
    sum *= shrink;
    max = next;
  }
  Lanes total = {};
  int64_t j = 0;
  for (; j + kLanes <= visible; j += kLanes) {
    const Lanes e = exp_of<Lanes, IntLanes>(load(s + j) - max);
    store(s + j, e);
    total += e;
  }
  float rest = 0.f;
  for (; j < visible; ++j) rest += (s[j] = exp_poly(s[j] - max));
  for (j = visible; j < block; ++j) s[j] = 0.f;
  sum += ::sum(total) + rest;
}

// One task: rows q0..q1 of q (at positions q0 + shift ..) of KV head g's query heads against
// keys 0..kend. `kt`: the head's keys transposed, block by block ([blocks][dim][block], zeros
// past the last key); `vp` its values, one contiguous row a key.
template <typename V, int R, int S>
__attribute__((always_inline)) inline void prefill_attention_task(const float* q, int64_t ldq, const float* kt,
                                                                  const float* vp, float* out, int64_t heads,
                                                                  int64_t kv_heads, int64_t dim, int64_t g,
                                                                  int64_t q0, int64_t q1, int64_t shift, int64_t kend,
                                                                  float scale) {
  constexpr int64_t width = sizeof(V) / sizeof(float), block = S * width;
  const int64_t rep = heads / kv_heads, rows = rep * (q1 - q0);
  // Row m is query q0 + m / rep of head g * rep + m % rep: a query's heads are neighbours.
  std::vector<float> qs(rows * dim), s(rows * block), o(rows * dim, 0.f), sum(rows, 0.f);
  std::vector<float> max(rows, -std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < rows; ++m)
    std::memcpy(&qs[m * dim], q + (q0 + m / rep) * ldq + (g * rep + m % rep) * dim, dim * sizeof(float));
  for (int64_t kb = 0; kb < kend; kb += block) {
    const int64_t keys = std::min(block, kend - kb);
    const float* kblock = kt + kb * dim;
    // Scores: R rows of queries against the block's transposed keys, panel_linear's pass.
    int64_t m = 0;
    for (; m + R <= rows; m += R)
      panel_pass<V, R, S>(&qs[m * dim], dim, kblock, block, 0, dim, &s[m * block], block, true);
    for (; m < rows; ++m) panel_pass<V, 1, S>(&qs[m * dim], dim, kblock, block, 0, dim, &s[m * block], block, true);
    for (m = 0; m < rows; ++m) {
      const int64_t visible = std::clamp<int64_t>(q0 + m / rep + shift - kb + 1, 0, keys);
      attn_softmax(&s[m * block], block, visible, scale, max[m], sum[m], &o[m * dim], dim);
    }
    // Values: R rows of probabilities against the block's value rows, `block` columns at a
    // time, added to the rows' outputs.
    const float* vb = vp + kb * dim;
    for (int64_t d = 0; d < dim; d += block) {
      for (m = 0; m + R <= rows; m += R)
        panel_pass<V, R, S>(&s[m * block], block, vb + d, dim, 0, keys, &o[m * dim + d], dim, false);
      for (; m < rows; ++m)
        panel_pass<V, 1, S>(&s[m * block], block, vb + d, dim, 0, keys, &o[m * dim + d], dim, false);
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    float* dst = out + (q0 + m / rep) * heads * dim + (g * rep + m % rep) * dim;
    const float inv = 1.f / sum[m];
    for (int64_t d = 0; d < dim; ++d) dst[d] = o[m * dim + d] * inv;
  }
}

// AVX2's 16 registers: three rows of four 8-float vectors (32 keys a block; two rows were 10%
// slower than SDPA at 4096 tokens, three 4% faster); AVX-512's 32: four rows of four 16-float
// vectors (64 keys; six rows were no faster).
void prefill_attention_avx2(const float* q, int64_t ldq, const float* kt, const float* vp, float* out, int64_t heads,
                            int64_t kv_heads, int64_t dim, int64_t g, int64_t q0, int64_t q1, int64_t shift,
                            int64_t kend, float scale) {
  prefill_attention_task<Lanes, 3, 4>(q, ldq, kt, vp, out, heads, kv_heads, dim, g, q0, q1, shift, kend, scale);
}

__attribute__((target("avx512f"))) void prefill_attention_avx512(const float* q, int64_t ldq, const float* kt,
                                                                  const float* vp, float* out, int64_t heads,
                                                                  int64_t kv_heads, int64_t dim, int64_t g,
                                                                  int64_t q0, int64_t q1, int64_t shift, int64_t kend,
                                                                  float scale) {
  prefill_attention_task<Wide, 4, 4>(q, ldq, kt, vp, out, heads, kv_heads, dim, g, q0, q1, shift, kend, scale);
}

constexpr int64_t kAttnQueries = 32;  // queries a task: with two heads a KV head, 64 rows

// One query block's task: rows q0..q1 of q, at positions q0 + shift .., of KV head g, reading
// keys 0..kend of its chunk's transposed keys and values.
struct AttnTask {
  int64_t chunk, g, q0, q1, shift, kend;
};

// q [N, H, D] (rows of whole heads, any row stride); the caches [blocks, block_size, KVH, D]
// (head_dim contiguous, any other strides: the worker's pages are head-major); table [R, W]
// int64, request r's pages; chunks [R, 3] int64: request r's first row of q, its rows, and the
// position of that row (its tokens cached before). Writes the chunks' rows of out [N, H, D]
// (contiguous), leaving the others as they are.
void prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& table, const torch::Tensor& chunks, torch::Tensor out, double scale,
                       int64_t vector_bits) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() && out.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 [tokens, heads, dim] with each token's heads contiguous");
  check_pages(k_cache, "k_cache");
  check_pages(v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat && v_cache.scalar_type() == torch::kFloat,
              "the caches must be float32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat && out.is_contiguous(),
              "out must be a contiguous float32 tensor of q's shape");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), page = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim, "q and the caches have different head dims");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " heads do not share ", kv_heads, " KV heads evenly");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kLong && table.is_contiguous(),
              "table must be a contiguous int64 [requests, blocks]");
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 3 && chunks.size(0) == table.size(0) &&
                  chunks.scalar_type() == torch::kLong && chunks.is_contiguous(),
              "chunks must be a contiguous int64 [requests, 3], a row for each row of the table");
  TORCH_CHECK(vector_bits == 256 || (vector_bits == 512 && has_avx512()), vector_bits,
              "-bit vectors are not available on this CPU");
  const int64_t block = vector_bits == 512 ? 64 : 32;
  TORCH_CHECK(dim % block == 0, "a head of ", dim, " is not a whole number of blocks");
  const int64_t reqs = table.size(0), width = table.size(1);
  const int64_t* rows = table.data_ptr<int64_t>();
  const int64_t* spec = chunks.data_ptr<int64_t>();
  // Request r's keys: every slot of the pages its chunk reaches (`slots`), laid out for its
  // tasks from `kt_at` / `vp_at` on, each KV head `padded` (whole key blocks) apart.
  std::vector<int64_t> slots(reqs), padded(reqs), kt_at(reqs + 1, 0), vp_at(reqs + 1, 0), items_at(reqs + 1, 0);
  std::vector<AttnTask> tasks;
  for (int64_t r = 0; r < reqs; ++r) {
    const int64_t start = spec[r * 3], len = spec[r * 3 + 1], pos = spec[r * 3 + 2];
    TORCH_CHECK(start >= 0 && len > 0 && start + len <= tokens && pos >= 0, "chunk ", r, " (rows ", start, "..",
                start + len, ", position ", pos, ") is outside the step's ", tokens, " tokens");
    const int64_t pages = (pos + len + page - 1) / page;
    TORCH_CHECK(pages <= width, "chunk ", r, " reaches position ", pos + len - 1, ", outside its table");
    check_blocks(rows + r * width, pages, num_blocks, r);
    slots[r] = pages * page;
    padded[r] = (slots[r] + block - 1) / block * block;
    kt_at[r + 1] = kt_at[r] + kv_heads * padded[r] * dim;
    vp_at[r + 1] = vp_at[r] + kv_heads * slots[r] * dim;
    items_at[r + 1] = items_at[r] + kv_heads * (padded[r] / block);
    for (int64_t q0 = start; q0 < start + len; q0 += kAttnQueries) {
      const int64_t q1 = std::min(start + len, q0 + kAttnQueries);
      for (int64_t g = 0; g < kv_heads; ++g)
        tasks.push_back({r, g, q0, q1, pos - start, q1 == start + len ? slots[r] : pos - start + q1});
    }
  }
  // Each chunk's KV heads, keys transposed block by block and values row by row, once: every
  // query block reads them again (a task transposing its own blocks spent as long on that as on
  // the products at 2048 tokens), and a key's row in the pages is KV heads apart.
  auto kt = torch::empty({kt_at[reqs]}, q.options());
  auto vp = torch::empty({vp_at[reqs]}, q.options());
  const float *k_ptr = k_cache.data_ptr<float>(), *v_ptr = v_cache.data_ptr<float>();
  float *kt_ptr = kt.data_ptr<float>(), *vp_ptr = vp.data_ptr<float>();
  const int64_t kpage = k_cache.stride(0), kslot = k_cache.stride(1), khead = k_cache.stride(2);
  const int64_t vpage = v_cache.stride(0), vslot = v_cache.stride(1), vhead = v_cache.stride(2);
  at::parallel_for(0, items_at[reqs], 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = std::upper_bound(items_at.begin(), items_at.end(), item) - items_at.begin() - 1;
      const int64_t local = item - items_at[r], per_head = padded[r] / block;
      const int64_t g = local / per_head, kb = local % per_head * block;
      float* dst = kt_ptr + kt_at[r] + g * padded[r] * dim + kb * dim;
      for (int64_t j = 0; j < block; ++j) {
        const int64_t slot = kb + j;
        if (slot >= slots[r]) {
          for (int64_t d = 0; d < dim; ++d) dst[d * block + j] = 0.f;
          continue;
        }
        const int64_t p = rows[r * width + slot / page], at = slot % page;
        const float* key = k_ptr + p * kpage + at * kslot + g * khead;
        for (int64_t d = 0; d < dim; ++d) dst[d * block + j] = key[d];
        std::memcpy(vp_ptr + vp_at[r] + (g * slots[r] + slot) * dim, v_ptr + p * vpage + at * vslot + g * vhead,
                    dim * sizeof(float));
      }
    }
  });
  // The query blocks that read the most keys go first, from a shared counter.
  std::stable_sort(tasks.begin(), tasks.end(), [](const AttnTask& a, const AttnTask& b) { return a.kend > b.kend; });
  const auto task = vector_bits == 512 ? prefill_attention_avx512 : prefill_attention_avx2;
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t ldq = q.stride(0), count = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < count;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      const AttnTask& a = tasks[t];
      task(q_ptr, ldq, kt_ptr + kt_at[a.chunk] + a.g * padded[a.chunk] * dim,
           vp_ptr + vp_at[a.chunk] + a.g * slots[a.chunk] * dim, out_ptr, heads, kv_heads, dim, a.g, a.q0, a.q1,
           a.shift, a.kend, static_cast<float>(scale));
    }
  });
}

// A packed projection as `Linear.forward` runs it at inference: panel_linear on its panels up to
// the row limit, oneDNN's packed matmul above it and where the panels were not the checked
// layout (no panels).
struct Projection {
  c10::optional<torch::Tensor> panels;
  torch::Tensor packed;
  c10::optional<torch::Tensor> bias;
  int64_t out_features;
};

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                                 c10::optional<std::string>("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// `p` on rows x as `Linear.forward` runs it: panel_linear on the panels up to `panel_rows` rows,
// oneDNN's packed matmul above that and where there are no panels.
torch::Tensor run(const Projection& p, torch::Tensor x, int64_t panel_rows, int64_t vector_bits) {
  if (p.panels.has_value() && x.size(0) <= panel_rows) {
    if (x.stride(1) != 1) x = x.contiguous();
    return panel_linear(x, *p.panels, p.bias, p.out_features, vector_bits);
  }
  return onednn_linear(x, p.packed, p.bias);
}

// An MLP's activation on its first projection's output `h`, as models/mlp.py takes it: SwiGLU
// (gate and up stacked: silu(gate) * up) or relu^2, in place where no gradient is recorded.
torch::Tensor activate(torch::Tensor h, bool gated) {
  if (!gated) return h.relu_().square_();
  const int64_t inter = h.size(1) / 2;
  return at::silu(h.narrow(1, 0, inter)).mul_(h.narrow(1, inter, inter));
}

// The routed experts of a mixture-of-experts layer (models/moe.py), each a SwiGLU or relu^2
// MLP, run side by side: the threads take whole experts from a shared counter, largest share
// of rows first, and each expert's matmuls run on the one thread that took it (a call inside
// the parallel region: oneDNN, panel_linear and ATen's ops then run on the calling thread).
// Run one after another, as the layer's Python loop did, every expert's two matmuls were
// split across the threads: at a prefill's ~16 rows an expert, 96 calls a layer each paid a
// fork and a barrier and split a 256-wide output in two, and a real-size MoE layer took 9.7 ms
// at 128 tokens where side by side it takes 7.1 (docs/design.md §20). Each expert's arithmetic
// is the one its Python forward does; only oneDNN's split of a matmul across threads differs,
// so outputs agree to rounding (bit for bit where panel_linear runs).
class ExpertGroup {
 public:
  ExpertGroup(bool gated, int64_t panel_rows, int64_t vector_bits)
      : gated_(gated), panel_rows_(panel_rows), vector_bits_(vector_bits) {}

  void add(Projection first, Projection second) {
    TORCH_CHECK(!gated_ || first.out_features % 2 == 0, "a SwiGLU expert's first projection stacks gate and up");
    TORCH_CHECK(experts_.empty() || second.out_features == experts_.front().second.out_features,
                "every expert has the same output width");
    experts_.push_back({std::move(first), std::move(second)});
  }

  // rows [R, in] grouped by expert: counts[e] rows of expert e, in expert order. Returns each
  // row's expert output [R, out], in the same order.
  torch::Tensor forward(const torch::Tensor& rows, const std::vector<int64_t>& counts) const {
    TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kFloat && rows.device().is_cpu(),
                "rows must be CPU float32 [rows, features]");
    TORCH_CHECK(counts.size() == experts_.size(), "one count an expert: ", counts.size(), " for ",
                experts_.size());
    std::vector<int64_t> start(counts.size() + 1, 0);
    for (size_t e = 0; e < counts.size(); ++e) {
      TORCH_CHECK(counts[e] >= 0, "a negative count");
      start[e + 1] = start[e] + counts[e];
    }
    TORCH_CHECK(start.back() == rows.size(0), "the counts sum to ", start.back(), ", not the ", rows.size(0), " rows");
    const int64_t width = experts_.empty() ? 0 : experts_.front().second.out_features;
    auto out = torch::empty({rows.size(0), width}, rows.options());
    std::vector<int64_t> order;
    for (size_t e = 0; e < counts.size(); ++e)
      if (counts[e] > 0) order.push_back(static_cast<int64_t>(e));
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(order.size()));
    std::atomic<size_t> next{0};
    // The team's threads dispatch ATen ops: they take the caller's inference mode and grad mode.
    const at::ThreadLocalState caller;
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      const at::ThreadLocalStateGuard as_caller(caller);
      for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < order.size();
           i = next.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t e = order[i];
        const Expert& expert = experts_[e];
        auto h = activate(run(expert.first, rows.narrow(0, start[e], counts[e]), panel_rows_, vector_bits_), gated_);
        out.narrow(0, start[e], counts[e]).copy_(run(expert.second, h, panel_rows_, vector_bits_));
      }
    });
    return out;
  }

 private:
  struct Expert {
    Projection first, second;
  };
  bool gated_;
  int64_t panel_rows_, vector_bits_;
  std::vector<Expert> experts_;
};

// The shapes of a Mamba2 mixer's input projection and state, as models/mamba.py splits them.
struct MambaShape {
  int64_t intermediate, conv_dim, heads, head_dim, groups, state;
};

// A Mamba2 mixer's constants: `a` is -exp(A_log), the value the mixer computes every step.
struct MambaParams {
  torch::Tensor conv_weight;
  c10::optional<torch::Tensor> conv_bias;
  torch::Tensor dt_bias, a, d, norm;
  double dt_min, norm_eps;
  int64_t norm_group;
};

// A mixture-of-experts MLP's router, as models/moe.py's `Router` holds it: `correction` (the
// e_score_correction_bias) present means NemotronH's grouped sigmoid choice, absent Qwen's
// softmax over the experts.
struct RouterParams {
  torch::Tensor weight;  // [experts, hidden]
  c10::optional<torch::Tensor> correction;
  int64_t top_k, n_group, topk_group;
  bool norm_topk_prob;
  double routed_scaling_factor;
};

// A mixture-of-experts MLP (models/moe.py's `MoE`): its router, its routed experts, NemotronH's
// latent projections into and out of them, and the shared expert (SwiGLU or relu^2) where the
// model has one.
struct MoEParams {
  RouterParams router;
  ExpertGroup experts;
  c10::optional<Projection> latent_in, latent_out, shared_in, shared_out;
  bool shared_gated;
};

// A decode step (one token a request) through a model's stack of pre-norm residual blocks,
// h = h + mixer(rms_norm(h)), as one call: each block runs the same kernels and ATen ops, in
// the same order, as its Python forward does on such a step (models/decode_stack.py), so the
// output is the layers' bit for bit. Blocks: attention (Qwen3's with its q/k norm and
// rotation, or plain), a SwiGLU or relu^2 MLP, a mixture of experts, a Mamba2 mixer. At batch 1
// of a ~0.6B model the Python and dispatch of a step's ~400 calls took ~15% of it, with the
// other thread idle; a mixture's routing and regrouping adds ~20 calls a layer.
class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double qk_eps, int64_t panel_rows,
              int64_t vector_bits)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), qk_eps_(qk_eps),
        panel_rows_(panel_rows), vector_bits_(vector_bits) {}

  // `qk_norm`: Qwen3's stacked q and k norm weights [heads + kv_heads, head_dim], which also
  // turn on the rotation; none for attention without either (NemotronH).
  void add_attention(torch::Tensor norm, double eps, Projection qkv, Projection o,
                     c10::optional<torch::Tensor> qk_norm) {
    TORCH_CHECK(qkv.out_features == (heads_ + 2 * kv_heads_) * head_dim_, "qkv has ", qkv.out_features,
                " outputs, not (heads + 2 kv_heads) * head_dim");
    blocks_.push_back({Kind::kAttention, std::move(norm), eps, std::move(qkv), std::move(o), std::move(qk_norm)});
    ++num_attention_;
  }

  void add_swiglu(torch::Tensor norm, double eps, Projection gate_up, Projection down) {
    TORCH_CHECK(gate_up.out_features % 2 == 0, "gate_up stacks two projections of one width");
    blocks_.push_back({Kind::kSwiGLU, std::move(norm), eps, std::move(gate_up), std::move(down)});
  }

  void add_relu2(torch::Tensor norm, double eps, Projection up, Projection down) {
    blocks_.push_back({Kind::kRelu2, std::move(norm), eps, std::move(up), std::move(down)});
  }

  void add_moe(torch::Tensor norm, double eps, MoEParams params) {
    TORCH_CHECK(params.router.top_k > 0 && params.router.top_k <= params.router.weight.size(0),
                "top_k must pick between one and all of the ", params.router.weight.size(0), " experts");
    TORCH_CHECK(!params.router.correction || params.router.weight.size(0) % params.router.n_group == 0,
                "the expert groups must divide the experts");
    TORCH_CHECK(params.latent_in.has_value() == params.latent_out.has_value(), "latent projections come in pairs");
    TORCH_CHECK(params.shared_in.has_value() == params.shared_out.has_value(), "a shared expert has two projections");
    Block block{Kind::kMoE, std::move(norm), eps};
    block.moe = std::make_shared<const MoEParams>(std::move(params));
    blocks_.push_back(std::move(block));
  }

  void add_mamba2(torch::Tensor norm, double eps, Projection in, Projection out, MambaShape shape, MambaParams params) {
    TORCH_CHECK(in.out_features == shape.intermediate + shape.conv_dim + shape.heads,
                "in_proj's outputs are not intermediate + conv_dim + heads");
    TORCH_CHECK(shape.intermediate % params.norm_group == 0, "the gated norm's groups must divide the width");
    Block block{Kind::kMamba2, std::move(norm), eps, std::move(in), std::move(out)};
    block.shape = shape;
    block.mamba = std::move(params);
    blocks_.push_back(std::move(block));
    ++num_mamba_;
  }

  // h [tokens, hidden]. Attention blocks take their pages, in block order, from `k_caches` and
  // `v_caches`, all through the one set of write slots, table and positions (one cache group);
  // cos and signed sin [tokens, head_dim] rotate Qwen3's q and k. Mamba2 blocks take their
  // conv and SSM states and slots, in block order, and the step's state spans.
  torch::Tensor forward(torch::Tensor h, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                        const c10::optional<torch::Tensor>& write_blocks,
                        const c10::optional<torch::Tensor>& write_offsets, const c10::optional<torch::Tensor>& table,
                        const torch::Tensor& positions, const c10::optional<torch::Tensor>& cos,
                        const c10::optional<torch::Tensor>& sin, std::vector<torch::Tensor> conv_caches,
                        std::vector<torch::Tensor> ssm_caches, const std::vector<torch::Tensor>& slots,
                        const c10::optional<torch::Tensor>& starts, const c10::optional<torch::Tensor>& fresh) const {
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat, "h must be float32 [tokens, hidden]");
    TORCH_CHECK(k_caches.size() == num_attention_ && v_caches.size() == num_attention_,
                "one K and one V cache an attention block");
    TORCH_CHECK(num_attention_ == 0 || (write_blocks && write_offsets && table),
                "attention needs the step's slots and table");
    TORCH_CHECK(conv_caches.size() == num_mamba_ && ssm_caches.size() == num_mamba_ && slots.size() == num_mamba_,
                "one conv state, SSM state and slots a Mamba2 block");
    size_t attention = 0, mamba = 0;
    for (const Block& b : blocks_) {
      auto x = rms_norm(h, b.norm, b.eps);
      switch (b.kind) {
        case Kind::kAttention: {
          const size_t i = attention++;
          x = attend(b, x, k_caches[i], v_caches[i], *write_blocks, *write_offsets, *table, positions, cos, sin);
          break;
        }
        case Kind::kSwiGLU:
          x = project(b.out, activate(project(b.in, x), true));
          break;
        case Kind::kRelu2:
          x = project(b.out, activate(project(b.in, x), false));
          break;
        case Kind::kMoE:
          x = moe(*b.moe, x);
          break;
        case Kind::kMamba2: {
          const size_t i = mamba++;
          x = mamba2(b, x, conv_caches[i], ssm_caches[i], slots[i], starts, fresh);
          break;
        }
      }
      h = h + x;
    }
    return h;
  }

 private:
  enum class Kind { kAttention, kSwiGLU, kRelu2, kMoE, kMamba2 };

  struct Block {
    Kind kind;
    torch::Tensor norm;
    double eps;
    Projection in, out;  // qkv and o; gate_up and down; up and down; in_proj and out_proj
    c10::optional<torch::Tensor> qk_norm;
    MambaShape shape{};
    MambaParams mamba{};
    std::shared_ptr<const MoEParams> moe;
  };

  torch::Tensor project(const Projection& p, torch::Tensor x) const { return run(p, x, panel_rows_, vector_bits_); }

  // models/moe.py's `Router.forward`: each token's chosen experts [tokens, top_k] and weights.
  static std::tuple<torch::Tensor, torch::Tensor> route(const RouterParams& r, const torch::Tensor& x) {
    auto logits = at::linear(x, r.weight);
    if (!r.correction.has_value()) {
      auto [weights, ids] = at::softmax(logits, -1, at::kFloat).topk(r.top_k, -1);
      if (r.norm_topk_prob) weights = weights / weights.sum(-1, true);
      return {weights.to(logits.scalar_type()), ids};
    }
    const int64_t experts = r.weight.size(0);
    auto scores = logits.sigmoid();
    auto choice = scores + *r.correction;
    if (r.n_group > 1) {
      auto groups = choice.view({-1, r.n_group, experts / r.n_group});
      auto group_scores = std::get<0>(groups.topk(2, -1)).sum(-1);
      auto best = std::get<1>(group_scores.topk(r.topk_group, -1, true, false));
      auto keep = at::zeros_like(group_scores, at::kBool).scatter_(1, best, true);
      choice = groups.masked_fill(keep.logical_not().unsqueeze(-1), -std::numeric_limits<double>::infinity())
                   .view({-1, experts});
    }
    auto ids = std::get<1>(choice.topk(r.top_k, -1, true, false));
    auto weights = scores.gather(1, ids);
    if (r.norm_topk_prob) weights = weights / (weights.sum(-1, true) + 1e-20);
    return {weights * r.routed_scaling_factor, ids};
  }

  // models/moe.py's `run_experts` and `MoE.forward`: the (token, k) pairs sorted by expert
  // once, the experts side by side on their rows, the weighted rows summed back per token.
  torch::Tensor moe(const MoEParams& m, const torch::Tensor& x) const {
    auto [weights, ids] = route(m.router, x);
    const int64_t tokens = ids.size(0), top_k = ids.size(1);
    auto flat = ids.reshape(-1);
    auto order = at::argsort(flat, true);
    auto counted = at::bincount(flat, {}, m.router.weight.size(0));
    const int64_t* c = counted.data_ptr<int64_t>();
    const std::vector<int64_t> counts(c, c + counted.numel());
    auto inner = m.latent_in ? project(*m.latent_in, x) : x;
    auto rows = inner.index_select(0, order.div(top_k, "floor"));
    auto grouped = m.experts.forward(rows.contiguous(), counts);
    auto y = grouped * weights.reshape({-1, 1}).index_select(0, order);
    auto out = y.index_select(0, at::argsort(order)).view({tokens, top_k, -1}).sum(1).to(x.scalar_type());
    if (m.latent_out) out = project(*m.latent_out, out);
    if (m.shared_in) out = out + project(*m.shared_out, activate(project(*m.shared_in, x), m.shared_gated));
    return out;
  }

  torch::Tensor attend(const Block& b, const torch::Tensor& x, torch::Tensor k_cache, torch::Tensor v_cache,
                       const torch::Tensor& write_blocks, const torch::Tensor& write_offsets,
                       const torch::Tensor& table,
                       const torch::Tensor& positions, const c10::optional<torch::Tensor>& cos,
                       const c10::optional<torch::Tensor>& sin) const {
    const int64_t tokens = x.size(0);
    auto qkv = project(b.in, x).view({tokens, heads_ + 2 * kv_heads_, head_dim_});
    auto qk = qkv.narrow(1, 0, heads_ + kv_heads_);
    if (b.qk_norm.has_value()) {
      TORCH_CHECK(cos && sin, "q/k norm and rotation need the rotary table");
      qk = qk_norm_rope(qk, *b.qk_norm, *cos, *sin, qk_eps_);
    }
    write_kv(k_cache, v_cache, qk.narrow(1, heads_, kv_heads_), qkv.narrow(1, heads_ + kv_heads_, kv_heads_),
             write_blocks, write_offsets);
    auto out =
        paged_decode_attention(qk.narrow(1, 0, heads_).contiguous(), k_cache, v_cache, table, positions, scale_);
    return project(b.out, out.flatten(-2));
  }

  torch::Tensor mamba2(const Block& b, const torch::Tensor& x, torch::Tensor conv_cache, torch::Tensor ssm_cache,
                       const torch::Tensor& slots, const c10::optional<torch::Tensor>& starts,
                       const c10::optional<torch::Tensor>& fresh) const {
    const MambaShape& s = b.shape;
    const MambaParams& m = b.mamba;
    const int64_t tokens = x.size(0), bc = s.groups * s.state;
    auto in = project(b.in, x);
    auto gate = in.narrow(1, 0, s.intermediate), dt = in.narrow(1, s.intermediate + s.conv_dim, s.heads);
    auto xbc = causal_conv(conv_cache, slots, in.narrow(1, s.intermediate, s.conv_dim), m.conv_weight, m.conv_bias,
                           starts, fresh);
    auto xs = xbc.narrow(1, 0, s.intermediate).view({tokens, s.heads, s.head_dim});
    auto bs = xbc.narrow(1, s.intermediate, bc).view({tokens, s.groups, s.state});
    auto cs = xbc.narrow(1, s.intermediate + bc, bc).view({tokens, s.groups, s.state});
    auto y = mamba_ssm_scan(ssm_cache, slots, xs.contiguous(), dt.contiguous(), m.dt_bias, m.a, m.d, bs.contiguous(),
                            cs.contiguous(), m.dt_min, starts, fresh);
    return project(b.out, gated_rms_norm(y.flatten(-2), gate, m.norm, m.norm_group, m.norm_eps));
  }

  int64_t heads_, kv_heads_, head_dim_;
  double scale_, qk_eps_;
  int64_t panel_rows_, vector_bits_;
  std::vector<Block> blocks_;
  size_t num_attention_ = 0, num_mamba_ = 0;
};

// Binds thread i of the calling thread's OpenMP team (the threads torch and oneDNN compute on
// for it) to cpus[i], one thread a CPU; the caller is thread 0. Returns the CPU each thread was
// bound to, by thread number, or an empty list where not every thread was (not Linux, a team
// of another size than the list, a failed call). A team bound only as a whole to a set of CPUs
// may have one thread moved onto another's core when a service process wakes on its own; the
// two then share a core, and every op's barrier waits for them (docs/design.md §13).
std::vector<int64_t> pin_team(const std::vector<int64_t>& cpus) {
  std::vector<int64_t> bound;
#ifdef __linux__
  const int64_t threads = at::get_num_threads();
  if (threads != static_cast<int64_t>(cpus.size())) return bound;
  std::vector<int64_t> got(threads, -1);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const int64_t self = at::get_thread_num();
    if (end - begin != 1 || self != begin) return;  // not one item a thread: reported unbound
    if (cpus[self] < 0 || cpus[self] >= CPU_SETSIZE) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[self]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) got[self] = cpus[self];
  });
  if (std::find(got.begin(), got.end(), -1) == got.end()) bound = got;
#endif
  return bound;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every op runs without the GIL, as torch's own ops do: a worker's event loop sends the
  // last step's tokens while the compute thread runs the next step (docs/design.md §13).
  const auto released = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, released);
  m.def("write_kv", &write_kv, released);
  m.def("mamba_ssm_scan", &mamba_ssm_scan, released);
  m.def("causal_conv", &causal_conv, released);
  m.def("qk_norm_rope", &qk_norm_rope, released);
  m.def("rms_norm", &rms_norm, released);
  m.def("gated_rms_norm", &gated_rms_norm, released);
  m.def("panel_linear", &panel_linear, released);
  m.def("prefill_attention", &prefill_attention, released);
  m.def("panel_vector_bits", &panel_vector_bits);
  m.def("pin_team", &pin_team);
  pybind11::class_<Projection>(m, "Projection")
      .def(pybind11::init<c10::optional<torch::Tensor>, torch::Tensor, c10::optional<torch::Tensor>, int64_t>());
  pybind11::class_<MambaShape>(m, "MambaShape")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>());
  pybind11::class_<MambaParams>(m, "MambaParams")
      .def(pybind11::init<torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, double, double, int64_t>());
  pybind11::class_<ExpertGroup>(m, "ExpertGroup")
      .def(pybind11::init<bool, int64_t, int64_t>())
      .def("add", &ExpertGroup::add)
      .def("forward", &ExpertGroup::forward, released);
  pybind11::class_<RouterParams>(m, "RouterParams")
      .def(pybind11::init<torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t, int64_t, bool, double>());
  pybind11::class_<MoEParams>(m, "MoEParams")
      .def(pybind11::init<RouterParams, ExpertGroup, c10::optional<Projection>, c10::optional<Projection>,
                          c10::optional<Projection>, c10::optional<Projection>, bool>());
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t, int64_t>())
      .def("add_attention", &DecodeStack::add_attention)
      .def("add_swiglu", &DecodeStack::add_swiglu)
      .def("add_relu2", &DecodeStack::add_relu2)
      .def("add_moe", &DecodeStack::add_moe)
      .def("add_mamba2", &DecodeStack::add_mamba2)
      .def("forward", &DecodeStack::forward, released);
}
