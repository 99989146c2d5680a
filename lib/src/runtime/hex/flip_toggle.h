// Flips HWY_TARGET_TOGGLE, as Highway's foreach_target.h does between its
// per-target passes, for the extra passes of avxvnni_pass.h. No include
// guard: each inclusion flips it once.
#ifdef HWY_TARGET_TOGGLE  // NOLINT(llvm-header-guard)
#undef HWY_TARGET_TOGGLE
#else
#define HWY_TARGET_TOGGLE
#endif
