// Run-time ISA selection: cpuid feature bits AND the OS-enabled register state (XGETBV), and for AMX the
// kernel's permission to use tile data (arch_prctl(ARCH_REQ_XCOMP_PERM), Linux 5.16+), so a kernel whose
// instructions the CPU or OS cannot execute is never called (no SIGILL).
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "moe_internal.h"

namespace kvp::moe {
namespace {

struct CpuFeatures {
  bool avx2 = false, avx512_base = false, avx512 = false, avx512_bf16 = false, amx = false;
  std::string why;  // why the widest tier is what it is (the first missing feature above it)
};

// AMX tile data is an XSAVE feature the process must ask for (Linux arch/x86/include/uapi/asm/prctl.h:
// ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18); without it the first tile load raises SIGILL.
bool amx_permitted() {
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  f.why = "no AVX (cpuid leaf 1) or the OS does not save AVX state (OSXSAVE)";
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool ymm_os = (xcr0 & 0x6) == 0x6, zmm_os = (xcr0 & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5);
  const bool f512 = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  const bool vnni = c & (1u << 11);
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24), amx_int8 = d & (1u << 25);
  const bool tile_os = (xcr0 & 0x60000) == 0x60000;  // XTILECFG and XTILEDATA enabled
  unsigned a1 = 0, b1, c1, d1;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool bf16 = a1 & (1u << 5);
  f.avx2 = avx2 && fma && ymm_os;
  f.avx512_base = f.avx2 && zmm_os && f512 && dq && bw && vl;
  f.avx512 = f.avx512_base && vnni;
  f.avx512_bf16 = f.avx512 && bf16;
  const bool amx_cpu = f.avx512_bf16 && amx_tile && amx_bf16 && amx_int8;
  f.amx = amx_cpu && tile_os && amx_permitted();
  if (!f.avx2)
    f.why = !ymm_os ? "the OS does not save YMM state (XCR0)" : "no AVX2 + FMA";
  else if (!f.avx512_base)
    f.why = !zmm_os ? "AVX2 + FMA; the OS does not save ZMM state (XCR0)" : "AVX2 + FMA; no AVX512 F/BW/VL/DQ";
  else if (!f.avx512)
    f.why = "AVX512 F/BW/VL/DQ, no VNNI (int8/int4 on vpmaddubsw; bf16 widened to fp32)";
  else
    f.why = f.amx           ? "AVX512 F/BW/VL/DQ + VNNI + BF16 + AMX-TILE/BF16/INT8"
            : amx_cpu       ? (!tile_os ? "AVX512 F/BW/VL/DQ + VNNI + BF16; AMX present but the OS does not enable tile "
                                          "state (XCR0)"
                                        : "AVX512 F/BW/VL/DQ + VNNI + BF16; AMX present but the kernel refused tile "
                                          "data (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16+ needed)")
            : f.avx512_bf16 ? "AVX512 F/BW/VL/DQ + VNNI + BF16, no AMX"
                            : "AVX512 F/BW/VL/DQ + VNNI, no AVX512-BF16 (bf16 weights widen to fp32)";
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

}  // namespace

bool isa_supported(Isa i) {
  switch (i) {
    case Isa::Scalar: return true;
    case Isa::Avx2: return features().avx2;
    case Isa::Avx512Base: return features().avx512_base;
    case Isa::Avx512: return features().avx512;
    case Isa::Avx512Bf16: return features().avx512_bf16;
    case Isa::Amx: return features().amx;
    case Isa::AmxEmulated: return features().avx512;
  }
  return false;
}

Isa best_isa() {
  if (features().amx) return Isa::Amx;
  if (features().avx512_bf16) return Isa::Avx512Bf16;
  if (features().avx512) return Isa::Avx512;
  if (features().avx512_base) return Isa::Avx512Base;
  if (features().avx2) return Isa::Avx2;
  return Isa::Scalar;
}

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512Base: return "avx512_base";
    case Isa::Avx512: return "avx512";
    case Isa::Avx512Bf16: return "avx512_bf16";
    case Isa::Amx: return "amx";
    case Isa::AmxEmulated: return "amx_emulated";
  }
  return "?";
}

const char* format_name(Format f) {
  switch (f) {
    case Format::BF16: return "bf16";
    case Format::INT8: return "int8";
    case Format::INT4: return "int4";
  }
  return "?";
}

const char* best_isa_reason() { return features().why.c_str(); }

const Kernels& kernels(Isa isa) {
  if (isa == Isa::Amx && isa_supported(isa)) return kAmxKernels;
  if (isa == Isa::AmxEmulated && isa_supported(isa)) return kAmxEmuKernels;
  if (isa == Isa::Avx512Bf16 && isa_supported(isa)) return kAvx512Bf16Kernels;
  if (isa == Isa::Avx512 && isa_supported(isa)) return kAvx512Kernels;
  if (isa == Isa::Avx512Base && isa_supported(isa)) return kAvx512BaseKernels;
  if (isa == Isa::Avx2 && isa_supported(isa)) return kAvx2Kernels;
  return kScalarKernels;
}

}  // namespace kvp::moe
