// A C interface to the parts of libmlx's C++ API the MLX backend uses.
//
// Every function catches every C++ exception and returns non-zero instead, with
// the message kept per thread for spx_last_error(); nothing unwinds into Rust.
// Arrays, maps and groups are heap handles the caller frees exactly once.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/distributed/distributed.h"
#include "mlx/distributed/ops.h"

namespace mx = mlx::core;

struct spx_array {
  mx::array a;
};
struct spx_map {
  std::unordered_map<std::string, mx::array> arrays;
  std::vector<std::string> keys;
};
struct spx_group {
  mx::distributed::Group g;
};

namespace {

thread_local std::string last_error;

template <typename F>
int guard(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return 1;
}

// Dtype codes shared with the Rust side.
mx::Dtype dtype_of(int code) {
  switch (code) {
    case 0: return mx::float32;
    case 1: return mx::float16;
    case 2: return mx::bfloat16;
    case 3: return mx::uint32;
    case 4: return mx::int32;
    case 5: return mx::uint8;
    default: throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  }
}

int code_of(mx::Dtype d) {
  if (d == mx::float32) return 0;
  if (d == mx::float16) return 1;
  if (d == mx::bfloat16) return 2;
  if (d == mx::uint32) return 3;
  if (d == mx::int32) return 4;
  if (d == mx::uint8) return 5;
  return -1;
}

mx::Shape shape_of(const int* dims, int ndim) { return mx::Shape(dims, dims + ndim); }

spx_array* wrap(mx::array a) { return new spx_array{std::move(a)}; }

std::optional<mx::array> opt(const spx_array* a) {
  if (a == nullptr) return std::nullopt;
  return a->a;
}

spx_map* wrap_map(std::unordered_map<std::string, mx::array> arrays) {
  auto* m = new spx_map{std::move(arrays), {}};
  for (auto& kv : m->arrays) m->keys.push_back(kv.first);
  return m;
}

std::optional<mx::distributed::Group> group_of(const spx_group* g) {
  if (g == nullptr) return std::nullopt;
  return g->g;
}

}  // namespace

#ifdef SHARDPLANE_OPENBLAS
extern "C" char* openblas_get_config(void);
#endif

extern "C" {

// The BLAS the CPU matmuls run on.
const char* spx_blas() {
#ifdef SHARDPLANE_OPENBLAS
  return openblas_get_config();
#else
  return "the BLAS libmlx links";
#endif
}

const char* spx_last_error() { return last_error.c_str(); }

int spx_version() { return MLX_VERSION_NUMERIC; }

size_t spx_cache_memory() { return mx::get_cache_memory(); }

void spx_array_free(spx_array* a) { delete a; }

int spx_array_from_data(const void* data, int dtype, const int* dims, int ndim, spx_array** out) {
  return guard([&] {
    auto d = dtype_of(dtype);
    auto shape = shape_of(dims, ndim);
    size_t n = 1;
    for (auto s : shape) n *= static_cast<size_t>(s);
    void* copy = std::malloc(n * d.size() > 0 ? n * d.size() : 1);
    if (copy == nullptr) throw std::bad_alloc();
    std::memcpy(copy, data, n * d.size());
    *out = wrap(mx::array(copy, shape, d, [](void* p) { std::free(p); }));
  });
}

int spx_array_ndim(const spx_array* a) { return static_cast<int>(a->a.ndim()); }

void spx_array_shape(const spx_array* a, int* dims) {
  for (size_t i = 0; i < a->a.ndim(); ++i) dims[i] = a->a.shape(static_cast<int>(i));
}

int spx_array_dtype(const spx_array* a) { return code_of(a->a.dtype()); }

size_t spx_array_nbytes(const spx_array* a) { return a->a.nbytes(); }

int spx_array_read(spx_array* a, int dtype, void* out, size_t nbytes) {
  return guard([&] {
    auto d = dtype_of(dtype);
    auto x = mx::contiguous(mx::astype(a->a, d));
    x.eval();
    if (x.nbytes() != nbytes) {
      throw std::invalid_argument("read of " + std::to_string(nbytes) + " bytes from an array of " +
                                  std::to_string(x.nbytes()));
    }
    std::memcpy(out, x.data<uint8_t>(), nbytes);
  });
}

int spx_eval(spx_array* const* arrays, size_t n) {
  return guard([&] {
    std::vector<mx::array> v;
    v.reserve(n);
    for (size_t i = 0; i < n; ++i) v.push_back(arrays[i]->a);
    mx::eval(v);
  });
}

int spx_astype(const spx_array* a, int dtype, spx_array** out) {
  return guard([&] { *out = wrap(mx::astype(a->a, dtype_of(dtype))); });
}

int spx_zeros(const int* dims, int ndim, int dtype, spx_array** out) {
  return guard([&] { *out = wrap(mx::zeros(shape_of(dims, ndim), dtype_of(dtype))); });
}

int spx_reshape(const spx_array* a, const int* dims, int ndim, spx_array** out) {
  return guard([&] { *out = wrap(mx::reshape(a->a, shape_of(dims, ndim))); });
}

int spx_transpose(const spx_array* a, const int* axes, int n, spx_array** out) {
  return guard([&] { *out = wrap(mx::transpose(a->a, std::vector<int>(axes, axes + n))); });
}

int spx_slice(const spx_array* a, const int* start, const int* stop, int n, spx_array** out) {
  return guard([&] { *out = wrap(mx::slice(a->a, shape_of(start, n), shape_of(stop, n))); });
}

int spx_slice_update(const spx_array* a, const spx_array* update, const int* start, const int* stop,
                     int n, spx_array** out) {
  return guard([&] {
    *out = wrap(mx::slice_update(a->a, update->a, shape_of(start, n), shape_of(stop, n)));
  });
}

int spx_concatenate(spx_array* const* arrays, size_t n, int axis, spx_array** out) {
  return guard([&] {
    std::vector<mx::array> v;
    for (size_t i = 0; i < n; ++i) v.push_back(arrays[i]->a);
    *out = wrap(mx::concatenate(v, axis));
  });
}

int spx_take(const spx_array* a, const spx_array* indices, int axis, spx_array** out) {
  return guard([&] { *out = wrap(mx::take(a->a, indices->a, axis)); });
}

int spx_add(const spx_array* a, const spx_array* b, spx_array** out) {
  return guard([&] { *out = wrap(mx::add(a->a, b->a)); });
}

int spx_multiply(const spx_array* a, const spx_array* b, spx_array** out) {
  return guard([&] { *out = wrap(mx::multiply(a->a, b->a)); });
}

int spx_sigmoid(const spx_array* a, spx_array** out) {
  return guard([&] { *out = wrap(mx::sigmoid(a->a)); });
}

int spx_silu(const spx_array* a, spx_array** out) {
  return guard([&] { *out = wrap(mx::multiply(a->a, mx::sigmoid(a->a))); });
}

// GELU, tanh approximation, as mlx.nn.gelu_approx computes it.
int spx_gelu_tanh(const spx_array* a, spx_array** out) {
  return guard([&] {
    const auto& x = a->a;
    auto cube = mx::power(x, mx::array(3.0f));
    auto inner = mx::multiply(mx::array(0.7978845608028654f)  // sqrt(2 / pi)
,
                              mx::add(x, mx::multiply(mx::array(0.044715f), cube)));
    *out = wrap(mx::multiply(mx::multiply(mx::array(0.5f), x),
                             mx::add(mx::array(1.0f), mx::tanh(inner))));
  });
}

// gpt-oss's gated unit: the gate clamped above at `limit`, the up
// projection to ±limit, then gate · sigmoid(alpha · gate) · (up + 1).
int spx_swiglu_oai(const spx_array* gate, const spx_array* up, float alpha, float limit,
                   spx_array** out) {
  return guard([&] {
    auto g = mx::minimum(gate->a, mx::array(limit));
    auto u = mx::clip(up->a, mx::array(-limit), mx::array(limit));
    auto glu = mx::multiply(g, mx::sigmoid(mx::multiply(mx::array(alpha), g)));
    *out = wrap(mx::multiply(glu, mx::add(u, mx::array(1.0f))));
  });
}

int spx_matmul(const spx_array* a, const spx_array* b, spx_array** out) {
  return guard([&] { *out = wrap(mx::matmul(a->a, b->a)); });
}

// `mode`: MLX's quantization mode ("affine", "mxfp4").
int spx_quantized_matmul(const spx_array* x, const spx_array* w, const spx_array* scales,
                         const spx_array* biases, int transpose, int group_size, int bits,
                         const char* mode, spx_array** out) {
  return guard([&] {
    *out = wrap(mx::quantized_matmul(x->a, w->a, scales->a, opt(biases), transpose != 0, group_size,
                                     bits, mode));
  });
}

// Routing of a mixture of experts: the softmax over the last axis (in
// float32), the k largest entries' indices (in no particular order) and
// their probabilities, renormalised to sum to one when `normalize`.
int spx_route(const spx_array* logits, int k, int normalize, spx_array** indices,
              spx_array** scores) {
  return guard([&] {
    auto probs = mx::softmax(mx::astype(logits->a, mx::float32), -1, true);
    int experts = probs.shape(-1);
    auto part = mx::argpartition(probs, experts - k, -1);
    mx::Shape stop = part.shape();
    mx::Shape start = stop;
    for (auto& d : start) d = 0;
    start.back() = experts - k;
    auto inds = mx::slice(part, start, stop);
    auto s = mx::take_along_axis(probs, inds, -1);
    if (normalize != 0) s = mx::divide(s, mx::sum(s, -1, true));
    *indices = wrap(inds);
    *scores = wrap(s);
  });
}

// x @ w[rhs_indices]^T for quantized stacked matrices `w` ([experts, out,
// in] packed, as mlx.nn's QuantizedSwitchLinear holds them).
int spx_gather_qmm(const spx_array* x, const spx_array* w, const spx_array* scales,
                   const spx_array* biases, const spx_array* rhs_indices, int group_size,
                   int bits, const char* mode, spx_array** out) {
  return guard([&] {
    *out = wrap(mx::gather_qmm(x->a, w->a, scales->a, opt(biases), std::nullopt, rhs_indices->a,
                               true, group_size, bits, mode));
  });
}

// x @ w[rhs_indices] for dense stacked matrices `w` ([experts, in, out]).
int spx_gather_mm(const spx_array* x, const spx_array* w, const spx_array* rhs_indices,
                  spx_array** out) {
  return guard([&] { *out = wrap(mx::gather_mm(x->a, w->a, std::nullopt, rhs_indices->a)); });
}

int spx_dequantize(const spx_array* w, const spx_array* scales, const spx_array* biases,
                   int group_size, int bits, const char* mode, spx_array** out) {
  return guard(
      [&] { *out = wrap(mx::dequantize(w->a, scales->a, opt(biases), group_size, bits, mode)); });
}

int spx_rms_norm(const spx_array* x, const spx_array* weight, float eps, spx_array** out) {
  return guard([&] { *out = wrap(mx::fast::rms_norm(x->a, opt(weight), eps)); });
}

// With `freqs` (per pair of dimensions, the period MLX divides positions
// by), `base` is unused.
int spx_rope(const spx_array* x, int dims, int traditional, float base, float scale, int offset,
             const spx_array* freqs, spx_array** out) {
  return guard([&] {
    std::optional<float> b = freqs == nullptr ? std::optional<float>(base) : std::nullopt;
    *out = wrap(mx::fast::rope(x->a, dims, traditional != 0, b, scale, offset, opt(freqs)));
  });
}

// mask_mode: 0 none, 1 causal (queries aligned to the end of the keys), 2 the
// additive `mask` array.
// `sinks` (one logit per query head, or null) join each head's softmax.
int spx_sdpa(const spx_array* q, const spx_array* k, const spx_array* v, float scale, int mask_mode,
             const spx_array* mask, const spx_array* sinks, spx_array** out) {
  return guard([&] {
    std::string mode = mask_mode == 1 ? "causal" : (mask_mode == 2 ? "array" : "");
    *out = wrap(mx::fast::scaled_dot_product_attention(
        q->a, k->a, v->a, scale, mode, mask_mode == 2 ? opt(mask) : std::nullopt, opt(sinks)));
  });
}

// Maps of named arrays (model files).

int spx_load_gguf(const char* path, spx_map** out) {
  return guard([&] { *out = wrap_map(mx::load_gguf(path).first); });
}

int spx_load_safetensors(const char* path, spx_map** out) {
  return guard([&] { *out = wrap_map(mx::load_safetensors(path).first); });
}

spx_map* spx_map_new() { return new spx_map{}; }

void spx_map_free(spx_map* m) { delete m; }

size_t spx_map_len(const spx_map* m) { return m->keys.size(); }

const char* spx_map_key(const spx_map* m, size_t i) { return m->keys[i].c_str(); }

int spx_map_contains(const spx_map* m, const char* name) {
  try {
    return m->arrays.count(name) == 1 ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

// Copies the array named `name` into *out; 1 with a message when absent.
int spx_map_get(const spx_map* m, const char* name, spx_array** out) {
  return guard([&] {
    auto it = m->arrays.find(name);
    if (it == m->arrays.end()) throw std::out_of_range(std::string("no tensor named ") + name);
    *out = wrap(it->second);
  });
}

int spx_map_insert(spx_map* m, const char* name, const spx_array* a) {
  return guard([&] {
    std::string key(name);
    if (m->arrays.count(key) == 0) m->keys.push_back(key);
    m->arrays.insert_or_assign(key, a->a);
  });
}

int spx_save_safetensors(const char* path, const spx_map* m) {
  return guard([&] { mx::save_safetensors(path, m->arrays, {{"format", "mlx"}}); });
}

// Distributed.

int spx_dist_is_available(const char* backend) {
  try {
    return mx::distributed::is_available(backend) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

int spx_dist_init(const char* backend, spx_group** out) {
  return guard([&] { *out = new spx_group{mx::distributed::init(true, backend)}; });
}

void spx_group_free(spx_group* g) { delete g; }

int spx_group_rank(const spx_group* g) { return g->g.rank(); }

int spx_group_size(const spx_group* g) { return g->g.size(); }

int spx_dist_send(const spx_array* a, int dst, const spx_group* g, spx_array** out) {
  return guard([&] { *out = wrap(mx::distributed::send(a->a, dst, group_of(g))); });
}

int spx_dist_recv(const int* dims, int ndim, int dtype, int src, const spx_group* g,
                  spx_array** out) {
  return guard([&] {
    *out = wrap(mx::distributed::recv(shape_of(dims, ndim), dtype_of(dtype), src, group_of(g)));
  });
}

int spx_dist_all_sum(const spx_array* a, const spx_group* g, spx_array** out) {
  return guard([&] { *out = wrap(mx::distributed::all_sum(a->a, group_of(g))); });
}

}  // extern "C"
