// The integrity seal of a bundle (format_version 2 on): a SHA-256 of the
// whole file after its first 512 bytes, recorded in those 512 bytes, which
// are the file's HDF5 user block. libhdf5 skips a user block (the superblock
// follows it), so h5py and every other HDF5 reader still open the file; kvcal
// reads and checks the seal with plain file reads *before* libhdf5 sees a byte,
// so accidental damage (a bit flip, a truncated copy) is an error instead of
// input to libhdf5's parser, which crashes on some damaged files.
//
// The user block, ASCII lines padded with NUL bytes to 512:
//   kvcal-seal 1
//   algorithm sha256
//   offset 512              (first byte covered)
//   length <N>              (bytes covered: the file is exactly 512 + N bytes)
//   sha256 <64 hex digits>  (SHA-256 of bytes [512, 512 + N))
// Every byte of the block is checked (the lines exactly, the padding zero).
//
// What it is not: a signature. Anyone can write a file with a matching seal,
// so a crafted file still reaches libhdf5; pin the expected digest of the
// whole file (runtime::BundleOpenOptions::expected_sha256) or check files in
// a child process (kvcal validate) where that matters.
#pragma once

#include <cstdint>
#include <string>

namespace kvcal {

inline constexpr std::uint64_t kSealSize = 512;  // the HDF5 user block holding the seal

enum class SealState {
  sealed,    // a seal that matched the file
  unsealed,  // the HDF5 signature at byte 0: a file written without a seal (format_version 1 bundles)
  neither,   // neither a seal nor the HDF5 signature at byte 0
};

struct SealCheck {
  SealState state = SealState::neither;
  std::uint64_t file_size = 0;
  std::uint64_t covered = 0;  // sealed: bytes covered (file_size - kSealSize)
  std::string sha256;         // sealed: the verified digest of the covered bytes (hex)
  std::string file_sha256;    // SHA-256 of the whole file (hex), when asked for
};

// Checks the seal of the file open at `fd` (read from offset 0 with pread; the
// descriptor's offset is not used); `path` only names the file in messages.
// Throws kvcal::Error "<path>: ..." when the file cannot be read, is shorter
// than its seal says (truncated) or longer, when the seal is damaged, or when
// the digest does not match. A file without a seal is not an error here: the
// state says what was found. With whole_file_digest the SHA-256 of every byte
// of the file is computed in the same pass (sha256sum's value).
SealCheck check_seal_fd(int fd, const std::string& path, bool whole_file_digest = false);

// The same, opening `path` read-only.
SealCheck check_seal(const std::string& path, bool whole_file_digest = false);

// Writes the seal into the first kSealSize bytes of `path`, a finished HDF5
// file created with a user block of kSealSize bytes (which must still be all
// zero). Throws kvcal::Error.
void write_seal(const std::string& path);

// "sha256 <first 16 hex digits>... over N bytes": a short description for reports.
std::string describe_seal(const SealCheck& check);

}  // namespace kvcal
