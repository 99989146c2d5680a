# Writes OUT: a C++ source with every schemas/*.json as a string, so that
# `kvcal validate` needs no files at run time.
file(GLOB schema_files "${SCHEMA_DIR}/*.json")
list(SORT schema_files)
set(body "// Generated from schemas/*.json by cmake/embed_schemas.cmake.\n#include <string>\n#include <utility>\n#include <vector>\n\nnamespace kvcal::detail {\nconst std::vector<std::pair<std::string, std::string>>& embedded_schemas() {\n  static const std::vector<std::pair<std::string, std::string>> schemas = {\n")
foreach(f ${schema_files})
  get_filename_component(name "${f}" NAME)
  file(READ "${f}" text)
  string(APPEND body "    {\"${name}\", R\"kvcalschema(${text})kvcalschema\"},\n")
endforeach()
string(APPEND body "  };\n  return schemas;\n}\n}  // namespace kvcal::detail\n")
file(WRITE "${OUT}.tmp" "${body}")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
