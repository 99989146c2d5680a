// The extra AVX2 pass of the integer kernels for AVX-VNNI.
//
// AVX-VNNI (VEX-encoded VPDPBUSD on 256- and 128-bit vectors: Intel Alder
// Lake and later client cores, Sierra Forest) is not a target of
// Highway 1.0.3, whose best target without AVX-512 is AVX2 (PMADDUBSW). The
// kernels are therefore compiled once more here for AVX2, as N_AVX2_VNNI,
// with DotBytes on VPDPBUSD and int32 accumulators (kPairTarget false), and
// the integer entry points take them where Highway chose AVX2 and the CPU
// has AVX-VNNI (cpuid leaf 7, subleaf 1, EAX bit 4). Not in the sanitizer
// builds (they leave out the row kernels this is for).
//
// Included at the end of each file of integer kernels (kernels_cpu.cpp,
// scores_int_cpu.cpp), after its per-target passes, with KVCAL_AVXVNNI_FILE
// naming the file; no include guard (each file includes it once). It leaves
// KVCAL_HAVE_AVXVNNI_KERNELS 1 where the pass was compiled, else 0.
#if HWY_ONCE && !defined(KVCAL_AVXVNNI_PASS)
#if HWY_ARCH_X86_64 && (HWY_TARGETS & HWY_AVX2) && KVCAL_ROW_KERNELS
#define KVCAL_AVXVNNI_PASS 1
#undef KVCAL_HAVE_AVXVNNI_KERNELS
#define KVCAL_HAVE_AVXVNNI_KERNELS 1
// set_macros-inl.h defines the per-target macros (HWY_NAMESPACE, the target
// attributes) once per toggle of HWY_TARGET_TOGGLE, as foreach_target.h
// flips it: flipped here for AVX2 and again for the static target after.
#pragma push_macro("HWY_TARGET")
#undef HWY_TARGET
#define HWY_TARGET HWY_AVX2
#ifdef HWY_TARGET_TOGGLE
#undef HWY_TARGET_TOGGLE
#else
#define HWY_TARGET_TOGGLE
#endif
#include <hwy/ops/set_macros-inl.h>
#include KVCAL_AVXVNNI_FILE  // NOLINT(bugprone-suspicious-include): the extra pass
#undef HWY_TARGET
#pragma pop_macro("HWY_TARGET")
#ifdef HWY_TARGET_TOGGLE
#undef HWY_TARGET_TOGGLE
#else
#define HWY_TARGET_TOGGLE
#endif
#include <hwy/ops/set_macros-inl.h>  // back to the static target's macros
#undef KVCAL_AVXVNNI_PASS
#undef KVCAL_KERNEL_NS
#define KVCAL_KERNEL_NS HWY_NAMESPACE
#else
#undef KVCAL_HAVE_AVXVNNI_KERNELS
#define KVCAL_HAVE_AVXVNNI_KERNELS 0
#endif
#endif
#undef KVCAL_AVXVNNI_FILE
