#pragma once
// Names the calling thread (Linux keeps 15 characters), so `top -H`, perf, gdb and
// /proc/<pid>/task/*/comm tell ECX's threads apart: the UCX progress thread, the
// control client's and server's I/O threads, the push dispatcher, and so on.

#include <string_view>

namespace ecx {

void name_this_thread(std::string_view name);

}  // namespace ecx
