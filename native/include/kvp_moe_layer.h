// One MoE layer's routed experts on the CPU: weights in one Format, SiLU-gated MLP per routed expert,
// outputs weighted by the router's top-k weights and summed per token.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

#include "kvp_moe.h"
#include "kvp_moe_pool.h"

namespace kvp::moe {

enum class Proj : int { Gate = 0, Up = 1, Down = 2 };

struct ForwardArgs {
  int T = 0, K = 0;
  const void* x = nullptr;  // [T, H], bf16 bits or float32
  bool x_bf16 = true;
  const int64_t* ids = nullptr;   // [T, K]; -1 = no expert
  const float* weights = nullptr; // [T, K]
  const uint8_t* skip = nullptr;  // [E] or null; nonzero = expert runs elsewhere (GPU), skipped
  float* out = nullptr;           // [T, H] float32
  bool accumulate = false;        // add into out instead of overwriting it
};

class Layer {
 public:
  // H and I multiples of 64; INT4 group a multiple of 64 dividing H and I. Throws std::invalid_argument.
  Layer(Format f, int experts, int hidden, int inter, int group, Isa isa);
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;
  // Quantize one projection of expert e from float rows: gate/up [I, H], down [H, I].
  void set_float(Pool& pool, int e, Proj p, const void* src, bool bf16);
  // Copy an already quantized projection (the `kvplugins kt convert` format) of expert e.
  void set_quantized(Pool& pool, int e, Proj p, const uint8_t* q, const float* scale);
  void forward(Pool& pool, const ForwardArgs& a);
  bool loaded(int e) const { return loaded_[e] == 7; }
  Format format() const { return f_; }
  Isa isa() const { return isa_; }
  int experts() const { return E_; }
  int hidden() const { return H_; }
  int inter() const { return I_; }
  int group() const { return G_; }

 private:
  // w1: gate/up interleaved in 16-row blocks [2I, H]; w2: down [H, I]. Both live in one alloc_weights block,
  // so small matrices (int8 down, int4) still sit on huge pages.
  struct Expert {
    Matrix w1, w2;
    uint8_t* block = nullptr;
    Expert() = default;
    Expert(const Expert&) = delete;
    Expert& operator=(const Expert&) = delete;
    ~Expert() { std::free(block); }
  };
  int dest_row(Proj p, int r) const;
  void place(Pool& pool, int e, Proj p, const std::function<void(int, uint8_t*, float*)>& fill);
  void check_args(const ForwardArgs& a) const;

  Format f_;
  int E_, H_, I_, G_;
  Isa isa_;
  const Kernels* kern_;
  std::vector<std::unique_ptr<Expert>> experts_;
  std::vector<uint8_t> loaded_;  // bit per projection
};

}  // namespace kvp::moe
