// The extra passes of the integer kernels for VPDPBUSD where Highway's target
// has none.
//
// AVX-VNNI (VEX-encoded VPDPBUSD on 256- and 128-bit vectors: Intel Alder
// Lake and later client cores, Sierra Forest) is not a target of
// Highway 1.0.3, whose best target without AVX-512 is AVX2 (PMADDUBSW). The
// kernels are therefore compiled once more here for AVX2, as N_AVX2_VNNI,
// with DotBytes on VPDPBUSD and int32 accumulators (kPairTarget false), and
// the integer entry points take them where Highway chose AVX2 and the CPU
// has AVX-VNNI (cpuid leaf 7, subleaf 1, EAX bit 4). Likewise AVX-512 VNNI
// without VBMI (Intel Cascade Lake and Cooper Lake: Highway's AVX3, whose
// kernels use PMADDUBSW; its AVX3_DL needs VBMI too): compiled once more for
// AVX3 as N_AVX3_VNNI (KVCAL_VNNI512_PASS also defined), EVEX VPDPBUSD, taken
// where Highway chose AVX3 and the CPU has AVX512_VNNI (leaf 7, subleaf 0,
// ECX bit 11). Not in the sanitizer builds (they leave out the row kernels
// this is for).
//
// Included at the end of each file of integer kernels (scores_int_cpu.cpp,
// values_int_cpu.cpp), after its per-target passes, with KVCAL_AVXVNNI_FILE
// naming the file; no include guard (each file includes it once). It leaves
// KVCAL_HAVE_AVXVNNI_KERNELS and KVCAL_HAVE_VNNI512_KERNELS 1 where the
// passes were compiled, else 0.
#if HWY_ONCE && !defined(KVCAL_AVXVNNI_PASS)
// set_macros-inl.h defines the per-target macros (HWY_NAMESPACE, the target
// attributes) once per toggle of HWY_TARGET_TOGGLE, as foreach_target.h
// flips it: flipped for the pass's target and again for the static target
// after.
#if HWY_ARCH_X86_64 && (HWY_TARGETS & HWY_AVX2) && KVCAL_ROW_KERNELS
#define KVCAL_AVXVNNI_PASS 1
#undef KVCAL_HAVE_AVXVNNI_KERNELS
#define KVCAL_HAVE_AVXVNNI_KERNELS 1
#pragma push_macro("HWY_TARGET")
#pragma push_macro("KVCAL_AVXVNNI_FILE")  // the pass's own inclusion of the file ends by removing it
#undef HWY_TARGET
#define HWY_TARGET HWY_AVX2
#include "runtime/hex/flip_toggle.h"
// (the macros of the flipped toggle's target)
#include <hwy/ops/set_macros-inl.h>
#include KVCAL_AVXVNNI_FILE  // NOLINT(bugprone-suspicious-include): the extra pass
#undef HWY_TARGET
#pragma pop_macro("KVCAL_AVXVNNI_FILE")
#pragma pop_macro("HWY_TARGET")
#include "runtime/hex/flip_toggle.h"
// (back to the static target's macros)
#include <hwy/ops/set_macros-inl.h>
#undef KVCAL_AVXVNNI_PASS
#else
#undef KVCAL_HAVE_AVXVNNI_KERNELS
#define KVCAL_HAVE_AVXVNNI_KERNELS 0
#endif
#if HWY_ARCH_X86_64 && (HWY_TARGETS & HWY_AVX3) && KVCAL_ROW_KERNELS
#define KVCAL_AVXVNNI_PASS 1
#define KVCAL_VNNI512_PASS 1
#undef KVCAL_HAVE_VNNI512_KERNELS
#define KVCAL_HAVE_VNNI512_KERNELS 1
#pragma push_macro("HWY_TARGET")
#undef HWY_TARGET
#define HWY_TARGET HWY_AVX3
#include "runtime/hex/flip_toggle.h"
// (the macros of the flipped toggle's target)
#include <hwy/ops/set_macros-inl.h>
// The per-target guard of the shared pieces (kernels_cpu-inl.h) passes where
// its macro's state matches the toggle's; the pass above flipped the toggle
// twice but the guard once, so it is set to match again for this one.
#if defined(KVCAL_RUNTIME_HEX_KERNELS_CPU_INL_H_) != defined(HWY_TARGET_TOGGLE)
#ifdef KVCAL_RUNTIME_HEX_KERNELS_CPU_INL_H_
#undef KVCAL_RUNTIME_HEX_KERNELS_CPU_INL_H_
#else
#define KVCAL_RUNTIME_HEX_KERNELS_CPU_INL_H_
#endif
#endif
#include KVCAL_AVXVNNI_FILE  // NOLINT(bugprone-suspicious-include): the extra pass
#undef HWY_TARGET
#pragma pop_macro("HWY_TARGET")
#include "runtime/hex/flip_toggle.h"
// (back to the static target's macros)
#include <hwy/ops/set_macros-inl.h>
#undef KVCAL_VNNI512_PASS
#undef KVCAL_AVXVNNI_PASS
#else
#undef KVCAL_HAVE_VNNI512_KERNELS
#define KVCAL_HAVE_VNNI512_KERNELS 0
#endif
#undef KVCAL_KERNEL_NS
#define KVCAL_KERNEL_NS HWY_NAMESPACE
// KVCAL_VNNI_DISPATCH(Fn(args)) returns Fn(args) of the pass that
// vnni_kernels() names, where one does (else goes on).
#if KVCAL_HAVE_AVXVNNI_KERNELS
#define KVCAL_VNNI_AVX2_CASE_(call) \
  case VnniKernels::kAvx2:          \
    return N_AVX2_VNNI::call;
#else
#define KVCAL_VNNI_AVX2_CASE_(call)
#endif
#if KVCAL_HAVE_VNNI512_KERNELS
#define KVCAL_VNNI_AVX3_CASE_(call) \
  case VnniKernels::kAvx3:          \
    return N_AVX3_VNNI::call;
#else
#define KVCAL_VNNI_AVX3_CASE_(call)
#endif
#define KVCAL_VNNI_DISPATCH(call) \
  switch (vnni_kernels()) {       \
    KVCAL_VNNI_AVX2_CASE_(call)   \
    KVCAL_VNNI_AVX3_CASE_(call)   \
    default:                      \
      break;                      \
  }
#endif
#undef KVCAL_AVXVNNI_FILE
