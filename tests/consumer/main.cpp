// Generates and certifies a mask, writes and re-reads it, through the
// installed kvcal library.
#include <cstdio>
#include <string>

#include "kvcal/core/version.h"
#include "kvcal/graph/generate.h"
#include "kvcal/io/masks.h"
#include "kvcal/spectral/certify.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const kvcal::MaskShape shape = kvcal::resolve_shape(96, 128, 4, std::nullopt);
  kvcal::MaskRecord rec;
  rec.id = "mask_0000";
  rec.method = "random";
  rec.seed = 1;
  rec.mask = kvcal::generate_random(shape, 1);
  rec.certificate = kvcal::certify(rec.mask);
  kvcal::write_mask_file(argv[1], {rec}, "consumer");
  const kvcal::MaskFile back = kvcal::read_mask_file(argv[1]);
  const bool ok = back.masks.size() == 1 && back.masks[0].mask == rec.mask && rec.certificate.ramanujan;
  std::printf("kvcal %s: sigma2 = %.6f, tau = %.6f, %s\n", kvcal::kVersion, rec.certificate.sigma2,
              rec.certificate.ramanujan_bound, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
