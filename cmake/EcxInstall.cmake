# `cmake --install` (and `make install PREFIX=...`): libecx, the ecx CLI, the public
# headers, a CMake package (find_package(ecx) -> ecx::ecx), a pkg-config file (ecx.pc)
# and, when built, the Python package (ecx with its native module ecx._core).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS ecx EXPORT ecxTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET ecx_cli)
  install(TARGETS ecx_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(DIRECTORY ${CMAKE_SOURCE_DIR}/include/ecx DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")

set(ECX_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ecx)
install(EXPORT ecxTargets NAMESPACE ecx:: DESTINATION ${ECX_CMAKE_INSTALL_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/ecxConfig.cmake.in ${CMAKE_BINARY_DIR}/ecxConfig.cmake
  INSTALL_DESTINATION ${ECX_CMAKE_INSTALL_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/ecxConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/ecxConfig.cmake ${CMAKE_BINARY_DIR}/ecxConfigVersion.cmake
  DESTINATION ${ECX_CMAKE_INSTALL_DIR})

# pkg-config: the headers include spdlog, fmt, nlohmann-json and msgpack; the
# library itself links the rest.
set(ECX_PC_REQUIRES "spdlog fmt nlohmann_json libzmq ucx libxxhash hiredis libcrypto")  # msgpack-cxx: header-only, no .pc on Debian
set(ECX_PC_CFLAGS "")
if(ECX_HAVE_CUDA)
  set(ECX_PC_CFLAGS "-DECX_HAVE_CUDA=1")
endif()
# Relative to the .pc file, so `cmake --install --prefix X` yields a correct file.
file(RELATIVE_PATH ECX_PC_TO_PREFIX /root/${CMAKE_INSTALL_LIBDIR}/pkgconfig /root)
configure_file(${CMAKE_CURRENT_LIST_DIR}/ecx.pc.in ${CMAKE_BINARY_DIR}/ecx.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/ecx.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

if(ECX_BUILD_PYTHON AND TARGET ecx_core_module)
  if(NOT DEFINED ECX_PYTHON_INSTALL_DIR)
    # Debian's interpreter reads <prefix>/lib/python3.X/dist-packages; others site-packages.
    set(site site-packages)
    if(EXISTS /usr/lib/python3/dist-packages)
      set(site dist-packages)
    endif()
    set(ECX_PYTHON_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/python${Python3_VERSION_MAJOR}.${Python3_VERSION_MINOR}/${site})
  endif()
  set(ECX_PYTHON_INSTALL_DIR ${ECX_PYTHON_INSTALL_DIR} CACHE STRING "Where the Python package ecx is installed (relative to the prefix, or absolute)")
  install(TARGETS ecx_core_module LIBRARY DESTINATION ${ECX_PYTHON_INSTALL_DIR}/ecx)
  install(DIRECTORY ${CMAKE_SOURCE_DIR}/python/ecx/ DESTINATION ${ECX_PYTHON_INSTALL_DIR}/ecx
    FILES_MATCHING PATTERN "*.py" PATTERN "__pycache__" EXCLUDE)
endif()
