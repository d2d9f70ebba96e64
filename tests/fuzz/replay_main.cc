// Replays a fuzz target's committed corpus through its LLVMFuzzerTestOneInput, once
// per file, without libFuzzer: `make test` (and the sanitizer presets) build every
// target this way with the default compiler, so an input that once found something, or
// that covers a path, keeps being checked on every change. A target signals a broken
// invariant by aborting, which fails the test.
//   replay_<target> <corpus folder>...

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);
// Defined by the targets that set themselves up once (logging off, for example).
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

std::vector<std::filesystem::path> corpus_files(const std::filesystem::path& folder, std::error_code& error) {
  std::vector<std::filesystem::path> files;
  for (std::filesystem::directory_iterator it(folder, error), end; !error && it != end; it.increment(error)) {
    if (it->is_regular_file(error)) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());  // a stable order, so a failure names the same file each run
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <corpus folder>...\n", argv[0]);
    return 2;
  }
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  std::size_t replayed = 0;
  for (int i = 1; i < argc; ++i) {
    std::error_code error;
    const auto files = corpus_files(argv[i], error);
    if (error) {
      std::fprintf(stderr, "cannot read the corpus folder %s: %s\n", argv[i], error.message().c_str());
      return 2;
    }
    for (const auto& file : files) {
      std::ifstream in(file, std::ios::binary);
      const std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      if (!in.good() && !in.eof()) {
        std::fprintf(stderr, "cannot read %s\n", file.c_str());
        return 2;
      }
      // Printed before the input runs: an abort leaves the culprit as the last line.
      std::fprintf(stderr, "%s\n", file.c_str());
      LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  }
  if (replayed == 0) {
    std::fprintf(stderr, "no inputs found: an empty corpus checks nothing\n");
    return 1;
  }
  std::printf("replayed %zu inputs\n", replayed);
  return 0;
}
