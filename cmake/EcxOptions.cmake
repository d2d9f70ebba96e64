# Warnings, sanitizers and CUDA detection shared by every target.
add_library(ecx_warnings INTERFACE)
target_compile_options(ecx_warnings INTERFACE -Wall -Wextra -Werror -Wpedantic -Wshadow
  -Wnon-virtual-dtor -Wcast-align -Woverloaded-virtual -Wimplicit-fallthrough)

if(NOT ECX_SANITIZE STREQUAL "" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC 12's flow analysis misfires on sanitizer-instrumented standard headers
  # (std::regex, std::function); the default build keeps the warning.
  target_compile_options(ecx_warnings INTERFACE -Wno-maybe-uninitialized)
endif()
if(ECX_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
  add_compile_definitions(ECX_SANITIZED=1)
elseif(ECX_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
  add_compile_definitions(ECX_SANITIZED=1)
elseif(NOT ECX_SANITIZE STREQUAL "")
  message(FATAL_ERROR "ECX_SANITIZE='${ECX_SANITIZE}': accepted values are '', 'address', 'thread'")
endif()

set(ECX_HAVE_CUDA OFF)
if(NOT ECX_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(ECX_HAVE_CUDA ON)
    message(STATUS "ecx: CUDA toolkit ${CUDAToolkit_VERSION} found; CUDA paths are compiled")
  elseif(ECX_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ECX_CUDA=ON but no CUDA toolkit was found")
  else()
    message(STATUS "ecx: no CUDA toolkit; CUDA paths are left out")
  endif()
endif()

# libFuzzer builds (`cmake --preset fuzz`): every library is instrumented for coverage
# and checked by ASan+UBSan; the fuzz_* executables add the libFuzzer driver.
if(ECX_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "ECX_FUZZ=ON needs clang (cmake --preset fuzz sets it)")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()
