// Temporary files of atomic writes, for callers that must clean up after a
// process that died mid-write (the CLI runs each command in a child process).
#pragma once

#include <functional>
#include <string>

namespace kvcal {

// Called with the path of every temporary file before it is created.
using TempFileObserver = std::function<void(const std::string&)>;
void set_temp_file_observer(TempFileObserver observer);

}  // namespace kvcal

namespace kvcal {

// Writes a text file atomically (temporary file beside it, then rename);
// throws kvcal::Error naming the problem and leaves nothing behind on failure.
void write_text_file(const std::string& path, const std::string& content);

}  // namespace kvcal
