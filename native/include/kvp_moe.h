// CPU MoE experts: weight formats, packed matrices, the SiLU-gated expert MLP, and the ISA dispatch.
// Never linked to torch. See native/src/moe/ and kvplugins/kt_expert_backend/.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvp::moe {

enum class Format : int { BF16 = 0, INT8 = 1, INT4 = 2 };
// Kernel tiers, narrowest first: Avx512Base = F/BW/VL/DQ (Skylake-SP: int8/int4 on vpmaddubsw), Avx512 = that
// + VNNI (Ice Lake, Cascade Lake), Avx512Bf16 = that +
// AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4/5), Amx = that + AMX-TILE/BF16/INT8 with the OS's permission
// for tile data (Sapphire Rapids and newer). AmxEmulated: the Amx tier's code with every tile instruction done
// in scalar C++ (amx_emulate.h), so CI tests its packing and tiling on CPUs without AMX; never picked by auto.
enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512Base = 2, Avx512 = 3, Avx512Bf16 = 4, Amx = 5, AmxEmulated = 6 };

const char* format_name(Format f);
const char* isa_name(Isa i);
Isa best_isa();                 // cpuid + XGETBV: the widest variant this CPU and OS can run
bool isa_supported(Isa i);
const char* best_isa_reason();  // why best_isa() is that tier: its features, or the first one missing above it

// A weight matrix W[N, K] (rows are output channels) in one format, rows contiguous:
//   BF16: N*K uint16;  INT8: N*K int8 + scale[N] (per channel);
//   INT4: N*K/2 bytes, per 64-element block byte j = (q[j] & 15) | (q[j+32] & 15) << 4 (two's complement
//   nibbles), scale[N*K/group]. Files and quantize_row hold the offset form (q + 8) instead: int4_to_memory
//   converts (XOR 0x88), so a kernel reads 16 * q from either nibble with one AND (and a shift), no subtract.
// comp[r] folds the +128 activation offset of the u8 x s8 dot products (int formats only).
struct Matrix {
  int N = 0, K = 0, group = 0;
  size_t row_bytes = 0;
  uint8_t* data = nullptr;      // 64-byte aligned; owned unless placed in a caller's block
  bool owned = true;
  std::vector<float> scale, comp;
  Matrix() = default;
  Matrix(const Matrix&) = delete;
  Matrix& operator=(const Matrix&) = delete;
  ~Matrix();
  // at: where the rows go (a block from alloc_weights, data_bytes long); nullptr allocates them here.
  void allocate(Format f, int n, int k, int g, uint8_t* at = nullptr);
  static size_t data_bytes(Format f, int n, int k);  // rounded up to 64
};

size_t row_bytes(Format f, int K);
// Weight memory, 2 MiB-aligned when it is 2 MiB or more, with MADV_HUGEPAGE (free with std::free): decode
// streams every byte once, and 4 KiB pages would cost a TLB walk per page. A tail under 1 MiB past the last full
// 2 MiB stays on small pages; a longer one gets a huge page (at most 1 MiB of physical memory unused).
uint8_t* alloc_weights(size_t bytes);

// Activations of one token, ready for a format: BF16 -> bf16 row; INT8/INT4 -> u8 row (q + 128) and a scale.
struct ActRows {
  const void* const* rows;
  const float* scale;   // per token, int formats only
  int n;
  const uint8_t* packed = nullptr;  // the same rows already in Kernels::pack's layout, or nullptr
};

// Plain view of a Matrix for the SIMD translation units: they use no std:: templates, so no inline function
// compiled with AVX-512 flags can be merged (ODR) into code the baseline build runs.
struct MatView {
  const uint8_t* data;
  size_t row_bytes;
  const float* scale;
  const float* comp;
  int N, K, group;
};
MatView view(const Matrix& m);

// y[t * ldy + j] = dot(act t, W row r0 + j) for j in [0, nrows); nrows is a multiple of 4.
using RowsGemm = void (*)(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy);

struct Kernels {
  RowsGemm gemm[3];  // by Format
  void (*silu_mul)(const float* gate, const float* up, float* out, int n);  // out = silu(gate) * up
  void (*to_bf16)(const float* src, uint16_t* dst, int n);                   // round to nearest even
  void (*to_u8)(const float* src, uint8_t* dst, float* scale, int n);        // quantize_act for INT8/INT4
  // Reorders a u8 activation row of K values in place into the order this table's INT4 kernel reads (nullptr:
  // natural order). Run on every INT4 activation row after quantizing it.
  void (*int4_act)(uint8_t* row, int K, int group);
  // By Format, nullptr where the tier's gemm reads rows as they are. Writes the n activation rows of
  // `row_bytes` bytes each into `out` in the order the tier's prefill gemm reads them (AMX: tiles of 16 tokens
  // x 64 bytes of K, transposed in 4-byte units), packed_bytes(n, row_bytes) bytes. Layer::forward packs each
  // expert's rows once per phase and hands them over in ActRows::packed.
  void (*pack[3])(const ActRows& a, int row_bytes, uint8_t* out);
};
// Bytes pack() writes for n rows: n rounded up to 16 tokens, times row_bytes.
inline size_t packed_bytes(int n, int row_bytes) { return size_t((n + 15) / 16) * 16 * size_t(row_bytes); }
const Kernels& kernels(Isa isa);

// One row of K values (bf16 bits when `bf16`, else float32) into format f: dst gets row_bytes(f, K) bytes,
// scale gets 1 (INT8) or K/group (INT4) floats. Weights: INT8 symmetric /127, INT4 symmetric /7 per group.
void quantize_row(Format f, const void* src, bool bf16, int K, int group, uint8_t* dst, float* scale);
// A row of INT4 bytes from the offset form (files, quantize_row) into the memory form (see Matrix), in place.
void int4_to_memory(uint8_t* row, size_t bytes);
// The +128 offset correction of a quantized row in the offset form (0 for BF16).
float comp_row(Format f, const uint8_t* row, const float* scale, int K, int group);
// One activation row for format f: BF16 -> bf16 bits; INT8/INT4 -> u8 (q + 128), *scale = amax / 127.
void quantize_act(Format f, const void* src, bool bf16, int K, void* dst, float* scale);

}  // namespace kvp::moe
