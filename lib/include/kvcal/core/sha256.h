// SHA-256 (FIPS 180-4), for artifact provenance and manifest checksums.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kvcal {

class Sha256 {
 public:
  // portable = true forces the plain C++ rounds even where the SHA CPU
  // extensions are used by default (for tests).
  explicit Sha256(bool portable = false);
  void update(const void* data, std::size_t size);
  // Finishes the hash; the object must not be updated afterwards.
  std::array<std::uint8_t, 32> digest();
  std::string hex_digest();

 private:
  void block(const std::uint8_t* p);
  std::uint32_t h_[8];
  std::uint8_t buf_[64];
  std::size_t buf_len_ = 0;
  bool portable_ = false;
  std::uint64_t total_ = 0;
};

// Hex SHA-256 of a whole file; throws kvcal::Error when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace kvcal
