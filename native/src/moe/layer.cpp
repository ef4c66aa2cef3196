// The SiLU-gated expert MLP of one MoE layer, in three parallel phases per forward:
//   A  gate/up rows x routed tokens -> h = silu(gate) * up    (tasks: expert x 64-row chunk of W1)
//   B  h rows -> kernel activation format                      (tasks: 16-row chunks)
//   C  down rows x h -> out[t] += w[t,k] * y                   (tasks: chunk of H rows, all experts)
// Phase C owns disjoint output rows, so no two tasks write one float. W1 interleaves gate and up rows in
// 16-row blocks so one task streams both halves it needs; row shards of each matrix belong to one subpool.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kvp_moe_layer.h"
#include "moe_internal.h"

namespace kvp::moe {
namespace {

constexpr int kBlock = 16;   // gate/up interleave block (rows)
constexpr int kChunkA = 64;  // W1 rows per phase-A task (4 blocks: 32 gate + 32 up rows)

std::invalid_argument bad(const std::string& what) { return std::invalid_argument(what); }

size_t act_bytes(Format f, int K) { return f == Format::BF16 ? size_t(K) * 2 : size_t(K); }

// Rows [0, n) split into `parts` shards aligned to `unit`; shard s is [lo(s), lo(s + 1)).
int shard_lo(int n, int parts, int unit, int s) { return int(int64_t(n / unit) * s / parts) * unit; }

struct Routing {
  std::vector<int> experts, off, tok;  // active expert ids; rows of expert a are [off[a], off[a + 1])
  std::vector<float> wt;
};

Routing route(const ForwardArgs& a, int E) {
  Routing r;
  std::vector<int> cnt(E, 0), slot(E, -1);
  for (int i = 0; i < a.T * a.K; ++i) {
    const int64_t e = a.ids[i];
    if (e >= 0 && !(a.skip && a.skip[e])) ++cnt[e];
  }
  r.off.push_back(0);
  for (int e = 0; e < E; ++e)
    if (cnt[e]) slot[e] = int(r.experts.size()), r.experts.push_back(e), r.off.push_back(r.off.back() + cnt[e]);
  r.tok.resize(r.off.back());
  r.wt.resize(r.off.back());
  std::vector<int> fill(r.off.begin(), r.off.end() - 1);
  for (int i = 0; i < a.T * a.K; ++i) {
    const int64_t e = a.ids[i];
    if (e < 0 || (a.skip && a.skip[e])) continue;
    const int p = fill[slot[e]]++;
    r.tok[p] = i / a.K, r.wt[p] = a.weights[i];
  }
  return r;
}

// Phase C rows per task. Prefill: 64 (a strip stays in L2 while token chunks reuse it). Decode streams each down
// matrix once: one chunk for one thread, else the fewest that give every thread two tasks, so each is one long
// sequential read (every chunk boundary restarts the prefetch stream). Always a divisor of H, a multiple of 16.
int down_chunk(int H, int threads, int T) {
  if (T > 4) return H / 64 >= 4 * threads ? 64 : 16;
  int cc = H;
  while (H / cc < (threads > 1 ? 2 * threads : 1) && cc % 32 == 0) cc /= 2;
  return cc;
}

// A row of n activations as float32: bf16 rows are widened into a per-thread buffer (exact), float rows as is.
const float* widen(const uint8_t* src, bool bf16, int n) {
  if (!bf16) return reinterpret_cast<const float*>(src);
  thread_local std::vector<float> buf;
  buf.resize(n);
  const uint16_t* b = reinterpret_cast<const uint16_t*>(src);
  for (int i = 0; i < n; ++i) buf[i] = bf16_to_f32(b[i]);
  return buf.data();
}

}  // namespace

Layer::Layer(Format f, int experts, int hidden, int inter, int group, Isa isa)
    : f_(f), E_(experts), H_(hidden), I_(inter), G_(f == Format::INT4 ? group : 0), isa_(isa) {
  if (experts < 1) throw bad("num_experts must be >= 1 (got " + std::to_string(experts) + ")");
  if (hidden < 64 || hidden % 64 || inter < 64 || inter % 64)
    throw bad("hidden_size and moe_intermediate_size must be positive multiples of 64 (got " +
              std::to_string(hidden) + ", " + std::to_string(inter) + ")");
  if (f == Format::INT4 && (group < 64 || group % 64 || hidden % group || inter % group))
    throw bad("int4 group size must be a multiple of 64 dividing hidden_size and moe_intermediate_size (got " +
              std::to_string(group) + ")");
  if (!isa_supported(isa)) throw bad(std::string("this CPU cannot run the ") + isa_name(isa) + " kernels");
  kern_ = &kernels(isa);
  experts_.resize(E_);
  loaded_.assign(E_, 0);
}

int Layer::dest_row(Proj p, int r) const {
  if (p == Proj::Down) return r;
  return (r / kBlock) * 2 * kBlock + (p == Proj::Up ? kBlock : 0) + r % kBlock;
}

void Layer::place(Pool& pool, int e, Proj p, const std::function<void(int, uint8_t*, float*)>& fill) {
  if (e < 0 || e >= E_) throw bad("expert " + std::to_string(e) + " out of range [0, " + std::to_string(E_) + ")");
  if (!experts_[e]) {
    auto x = std::make_unique<Expert>();
    const size_t b1 = Matrix::data_bytes(f_, 2 * I_, H_);
    x->block = alloc_weights(b1 + Matrix::data_bytes(f_, H_, I_));
    x->w1.allocate(f_, 2 * I_, H_, G_, x->block);
    x->w2.allocate(f_, H_, I_, G_, x->block + b1);
    experts_[e] = std::move(x);
  }
  Matrix& m = p == Proj::Down ? experts_[e]->w2 : experts_[e]->w1;
  const int rows = p == Proj::Down ? H_ : I_, S = pool.subpools(), step = 16;
  const size_t spr = f_ == Format::INT8 ? 1 : f_ == Format::INT4 ? size_t(m.K / G_) : 0;
  std::vector<int> counts(S);
  for (int s = 0; s < S; ++s) counts[s] = (shard_lo(rows, S, kBlock, s + 1) - shard_lo(rows, S, kBlock, s)) / step;
  pool.run(counts, [&](int s, int i) {  // shard s is first touched by subpool s (NUMA-local pages)
    for (int r = shard_lo(rows, S, kBlock, s) + i * step, end = r + step; r < end; ++r) {
      const int d = dest_row(p, r);
      uint8_t* dst = m.data + size_t(d) * m.row_bytes;
      float* sc = spr ? &m.scale[d * spr] : nullptr;
      fill(r, dst, sc);
      if (f_ != Format::BF16) m.comp[d] = comp_row(f_, dst, sc, m.K, G_);
      if (f_ == Format::INT4) int4_to_memory(dst, m.row_bytes);
    }
  });
  loaded_[e] |= uint8_t(1 << int(p));
}

void Layer::set_float(Pool& pool, int e, Proj p, const void* src, bool bf16) {
  const int K = p == Proj::Down ? I_ : H_;
  const size_t esz = bf16 ? 2 : 4;
  place(pool, e, p, [&](int r, uint8_t* dst, float* sc) {
    quantize_row(f_, static_cast<const uint8_t*>(src) + size_t(r) * K * esz, bf16, K, G_, dst, sc);
  });
}

void Layer::set_quantized(Pool& pool, int e, Proj p, const uint8_t* q, const float* scale) {
  const int K = p == Proj::Down ? I_ : H_;
  const size_t rb = row_bytes(f_, K), spr = f_ == Format::INT8 ? 1 : f_ == Format::INT4 ? size_t(K / G_) : 0;
  place(pool, e, p, [&](int r, uint8_t* dst, float* sc) {
    std::memcpy(dst, q + size_t(r) * rb, rb);
    if (spr) std::memcpy(sc, scale + size_t(r) * spr, spr * sizeof(float));
  });
}

void Layer::check_args(const ForwardArgs& a) const {
  if (a.T < 0 || a.K < 1) throw bad("forward: need T >= 0 tokens and K >= 1 experts per token");
  for (int i = 0; i < a.T * a.K; ++i) {
    const int64_t e = a.ids[i];
    if (e < -1 || e >= E_)
      throw bad("topk_ids holds expert " + std::to_string(e) + ", outside [-1, " + std::to_string(E_) + ")");
    if (e >= 0 && !(a.skip && a.skip[e]) && !loaded(int(e)))
      throw bad("expert " + std::to_string(e) + " is routed to the CPU but its weights were never loaded");
  }
}

void Layer::forward(Pool& pool, const ForwardArgs& a) {
  check_args(a);
  const Routing r = route(a, E_);
  const int S = pool.subpools(), n_act = int(r.experts.size()), rows = r.off.back();
  const size_t xb = act_bytes(f_, H_), hb = act_bytes(f_, I_), xesz = a.x_bf16 ? 2 : 4;
  // Scratch reused across forwards of the leader thread (the pool's job thread); tasks on other threads
  // reach it through these references (a thread_local named inside a lambda would be the worker's own).
  thread_local std::vector<uint8_t> tl_xact, tl_hact;
  thread_local std::vector<float> tl_xscale, tl_h, tl_hscale;
  thread_local std::vector<uint8_t> tl_xpack, tl_hpack;
  thread_local std::vector<size_t> tl_slot;
  auto &xact = tl_xact, &hact = tl_hact, &xpack = tl_xpack, &hpack = tl_hpack;
  auto &xscale = tl_xscale, &h = tl_h, &hscale = tl_hscale;
  auto& slot = tl_slot;  // packed token slots before active expert ai (16 per started block)
  const auto pack = a.T > 4 ? kern_->pack[int(f_)] : nullptr;
  if (pack) {
    slot.assign(n_act + 1, 0);
    for (int ai = 0; ai < n_act; ++ai) slot[ai + 1] = slot[ai] + packed_bytes(r.off[ai + 1] - r.off[ai], 1);
  }
  xact.resize(size_t(a.T) * xb), xscale.resize(a.T);
  h.resize(size_t(rows) * I_), hact.resize(size_t(rows) * hb), hscale.resize(rows);
  const std::vector<int> one(S, 0);
  auto first_sub = [&](int n) { std::vector<int> c(one); c[0] = n; return c; };
  constexpr int kTokStep = 8;
  pool.run(first_sub((a.T + kTokStep - 1) / kTokStep), [&](int, int i) {
    for (int t = i * kTokStep; t < std::min(a.T, (i + 1) * kTokStep); ++t) {
      const uint8_t* src = static_cast<const uint8_t*>(a.x) + size_t(t) * H_ * xesz;
      if (f_ == Format::BF16 && a.x_bf16)
        std::memcpy(&xact[t * xb], src, xb);
      else if (f_ == Format::BF16)
        kern_->to_bf16(reinterpret_cast<const float*>(src), reinterpret_cast<uint16_t*>(&xact[t * xb]), H_);
      else
        kern_->to_u8(widen(src, a.x_bf16, H_), &xact[t * xb], &xscale[t], H_);
      if (f_ == Format::INT4 && kern_->int4_act) kern_->int4_act(&xact[t * xb], H_, G_);
    }
  });
  // Each active expert's rows packed once for the tier's prefill gemm (Kernels::pack; AMX), used by every task.
  auto pack_experts = [&](std::vector<uint8_t>& out, size_t rb, auto row_of) {
    out.resize(slot[n_act] * rb);
    pool.run(first_sub(n_act), [&](int, int ai) {
      thread_local std::vector<const void*> prow;
      const int lo = r.off[ai], n = r.off[ai + 1] - lo;
      prow.resize(n);
      for (int j = 0; j < n; ++j) prow[j] = row_of(lo + j);
      pack(ActRows{prow.data(), nullptr, n}, int(rb), &out[slot[ai] * rb]);
    });
  };
  if (pack) pack_experts(xpack, xb, [&](int j) -> const void* { return &xact[r.tok[j] * xb]; });
  // Phase A: per subpool, its shard of W1 rows for every active expert.
  std::vector<int> ca(S);
  for (int s = 0; s < S; ++s) ca[s] = n_act * ((shard_lo(2 * I_, S, kChunkA, s + 1) - shard_lo(2 * I_, S, kChunkA, s)) / kChunkA);
  pool.run(ca, [&](int s, int i) {
    const int chunks = ca[s] / std::max(n_act, 1), ai = i / chunks, e = r.experts[ai];
    const int r0 = shard_lo(2 * I_, S, kChunkA, s) + (i % chunks) * kChunkA, lo = r.off[ai], n = r.off[ai + 1] - lo;
    thread_local std::vector<const void*> xrows;
    thread_local std::vector<float> xs, y;
    xrows.resize(n), xs.resize(n), y.resize(size_t(n) * kChunkA);
    for (int j = 0; j < n; ++j) xrows[j] = &xact[r.tok[lo + j] * xb], xs[j] = xscale[r.tok[lo + j]];
    const ActRows xa{xrows.data(), xs.data(), n, pack ? &xpack[slot[ai] * xb] : nullptr};
    kern_->gemm[int(f_)](view(experts_[e]->w1), r0, kChunkA, xa, y.data(), kChunkA);
    for (int j = 0; j < n; ++j)
      for (int b = 0; b < kChunkA; b += 2 * kBlock)
        kern_->silu_mul(&y[j * kChunkA + b], &y[j * kChunkA + b + kBlock], &h[size_t(lo + j) * I_ + (r0 + b) / 2], kBlock);
  });
  // Phase B: h rows into the kernel's activation format.
  pool.run(first_sub((rows + kTokStep - 1) / kTokStep), [&](int, int i) {
    for (int j = i * kTokStep; j < std::min(rows, (i + 1) * kTokStep); ++j) {
      if (f_ == Format::BF16)
        kern_->to_bf16(&h[size_t(j) * I_], reinterpret_cast<uint16_t*>(&hact[j * hb]), I_);
      else
        kern_->to_u8(&h[size_t(j) * I_], &hact[j * hb], &hscale[j], I_);
      if (f_ == Format::INT4 && kern_->int4_act) kern_->int4_act(&hact[j * hb], I_, G_);
    }
  });
  if (pack) pack_experts(hpack, hb, [&](int j) -> const void* { return &hact[size_t(j) * hb]; });
  // Phase C: each task owns H rows [r0, r0 + cc) of every token's output.
  const int cc = down_chunk(H_, pool.threads(), a.T);
  std::vector<int> cnt(S);
  for (int s = 0; s < S; ++s) cnt[s] = (shard_lo(H_, S, cc, s + 1) - shard_lo(H_, S, cc, s)) / cc;
  pool.run(cnt, [&](int s, int i) {
    const int r0 = shard_lo(H_, S, cc, s) + i * cc;
    if (!a.accumulate)
      for (int t = 0; t < a.T; ++t) std::fill_n(a.out + size_t(t) * H_ + r0, cc, 0.f);
    thread_local std::vector<const void*> hrows;
    thread_local std::vector<float> y;
    for (int ai = 0; ai < n_act; ++ai) {
      const int lo = r.off[ai], n = r.off[ai + 1] - lo;
      hrows.resize(n), y.resize(size_t(n) * cc);
      for (int j = 0; j < n; ++j) hrows[j] = &hact[size_t(lo + j) * hb];
      const ActRows ha{hrows.data(), &hscale[lo], n, pack ? &hpack[slot[ai] * hb] : nullptr};
      kern_->gemm[int(f_)](view(experts_[r.experts[ai]]->w2), r0, cc, ha, y.data(), cc);
      for (int j = 0; j < n; ++j) {
        float* o = a.out + size_t(r.tok[lo + j]) * H_ + r0;
        const float w = r.wt[lo + j];
        for (int c = 0; c < cc; ++c) o[c] += w * y[j * cc + c];
      }
    }
  });
}

}  // namespace kvp::moe
