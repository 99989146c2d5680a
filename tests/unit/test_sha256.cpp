#include <gtest/gtest.h>

#include <string>

#include "kvcal/core/sha256.h"

namespace kvcal {
namespace {

std::string sha(const std::string& s, bool portable = false) {
  Sha256 h(portable);
  h.update(s.data(), s.size());
  return h.hex_digest();
}

TEST(Sha256, FipsVectors) {
  EXPECT_EQ(sha(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PortableRoundsAgree) {
  for (const std::string& s : {std::string(""), std::string("abc"), std::string(1000, 'q'), std::string(65, 'x')}) {
    EXPECT_EQ(sha(s, true), sha(s, false)) << s.size();
  }
  EXPECT_EQ(sha(std::string(1000000, 'a'), true), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, ChunkingDoesNotMatter) {
  const std::string s(1000, 'x');
  Sha256 h;
  for (std::size_t i = 0; i < s.size(); i += 7) h.update(s.data() + i, std::min<std::size_t>(7, s.size() - i));
  EXPECT_EQ(h.hex_digest(), sha(s));
}

}  // namespace
}  // namespace kvcal
