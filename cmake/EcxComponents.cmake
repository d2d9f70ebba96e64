# ecx_component(NAME SOURCES ... [DEPENDS components...] [LIBS external...])
# Declares the static library ecx_<NAME> for src/<NAME>. DEPENDS may only name
# components below NAME in ECX_COMPONENT_ORDER, so dependencies always point down.
set_property(GLOBAL PROPERTY ECX_COMPONENT_TARGETS "")

#
# A component sees only its own headers and those of what it depends on (directly
# or through its dependencies): it compiles against a view of the tree made of links
# to exactly those folders (build/component-include/NAME/{ecx/<c>, <c>} for each
# such c), so including any other component's header fails the build. Code outside
# the components (tests, tools, benches) uses the whole tree: ecx_use_whole_tree().
function(ecx_use_whole_tree target scope)
  target_include_directories(${target} ${scope}
    $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/include> $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/src>)
endfunction()

# Where a component lives under src/ and include/ecx/: its name, unless
# ECX_COMPONENT_FOLDER_<name> says otherwise (e.g. connector/scheduler).
function(ecx_component_folder name out)
  if(DEFINED ECX_COMPONENT_FOLDER_${name})
    set(${out} ${ECX_COMPONENT_FOLDER_${name}} PARENT_SCOPE)
  else()
    set(${out} ${name} PARENT_SCOPE)
  endif()
endfunction()

function(ecx_component name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPENDS;LIBS" ${ARGN})
  list(FIND ECX_COMPONENT_ORDER ${name} my_index)
  if(name STREQUAL "proxy")
    # The proxy stands beside the engine: it may use core, and the store (the
    # cross-encoder cache's presence index), nothing else.
    set(allowed core store)
  elseif(my_index EQUAL -1)
    message(FATAL_ERROR "ecx_component(${name}): not listed in ECX_COMPONENT_ORDER")
  else()
    list(SUBLIST ECX_COMPONENT_ORDER 0 ${my_index} allowed)
  endif()
  set(deps "")
  foreach(dep IN LISTS ARG_DEPENDS)
    list(FIND allowed ${dep} dep_index)
    if(dep_index EQUAL -1)
      message(FATAL_ERROR "ecx_component(${name}) may not depend on '${dep}': dependencies point down (${ECX_COMPONENT_ORDER}; the proxy: ${allowed})")
    endif()
    list(APPEND deps ecx_${dep})
  endforeach()
  # What this component may include: itself and the closure of its DEPENDS.
  set(visible ${name})
  foreach(dep IN LISTS ARG_DEPENDS)
    get_property(dep_visible GLOBAL PROPERTY ECX_VISIBLE_${dep})
    list(APPEND visible ${dep} ${dep_visible})
  endforeach()
  list(REMOVE_DUPLICATES visible)
  set_property(GLOBAL PROPERTY ECX_VISIBLE_${name} ${visible})
  set(view ${CMAKE_BINARY_DIR}/component-include/${name})
  file(REMOVE_RECURSE ${view})
  file(MAKE_DIRECTORY ${view}/ecx)
  foreach(component IN LISTS visible)
    ecx_component_folder(${component} folder)
    get_filename_component(parent ${folder} DIRECTORY)
    if(parent)
      file(MAKE_DIRECTORY ${view}/ecx/${parent} ${view}/${parent})
    endif()
    if(EXISTS ${CMAKE_SOURCE_DIR}/include/ecx/${folder})
      file(CREATE_LINK ${CMAKE_SOURCE_DIR}/include/ecx/${folder} ${view}/ecx/${folder} SYMBOLIC)
    endif()
    file(CREATE_LINK ${CMAKE_SOURCE_DIR}/src/${folder} ${view}/${folder} SYMBOLIC)
  endforeach()
  add_library(ecx_${name} STATIC ${ARG_SOURCES})
  # PUBLIC: a component linking this one sees this view too, a subset of its own.
  target_include_directories(ecx_${name} PUBLIC $<BUILD_INTERFACE:${view}>)
  target_link_libraries(ecx_${name} PUBLIC ${deps} ${ARG_LIBS} PRIVATE ecx_warnings)
  if(ECX_HAVE_CUDA)
    target_compile_definitions(ecx_${name} PUBLIC ECX_HAVE_CUDA=1)
  endif()
  if(NOT name STREQUAL "proxy")
    set_property(GLOBAL APPEND PROPERTY ECX_COMPONENT_TARGETS ecx_${name})
    set_property(GLOBAL APPEND PROPERTY ECX_EXTERNAL_LIBS ${ARG_LIBS})
  endif()
endfunction()

# libecx.so: every engine component in one shared library (the proxy ships in the CLI).
function(ecx_add_shared_library)
  get_property(components GLOBAL PROPERTY ECX_COMPONENT_TARGETS)
  get_property(external GLOBAL PROPERTY ECX_EXTERNAL_LIBS)
  list(REMOVE_DUPLICATES external)
  add_library(ecx SHARED ${CMAKE_SOURCE_DIR}/src/libecx.cc)
  # The component archives go in whole and privately, so users of libecx get each
  # symbol once (from the .so); they still see the headers and external libraries.
  # The archives are named by file, not by target: linked as targets they also come in
  # plainly through the DEPENDS of the components above them, and CMake refuses a
  # library linked both with and without the WHOLE_ARCHIVE feature.
  set(archives "")
  foreach(component IN LISTS components)
    list(APPEND archives "$<TARGET_FILE:${component}>")
  endforeach()
  add_dependencies(ecx ${components})
  target_link_libraries(ecx PRIVATE "-Wl,--whole-archive" ${archives} "-Wl,--no-whole-archive" ecx_warnings
                        PUBLIC ${external})
  target_include_directories(ecx PUBLIC
    $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/include> $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/src>
    $<INSTALL_INTERFACE:include>)
  if(ECX_HAVE_CUDA)
    target_compile_definitions(ecx PUBLIC ECX_HAVE_CUDA=1)
  endif()
  set_target_properties(ecx PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR})
endfunction()
