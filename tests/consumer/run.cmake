# Installs the built lintape into a fresh prefix, builds tests/consumer against it (with the README's C++
# examples), runs them and checks their output, and checks that the consumer needs no header of lintape's
# dependencies: no installed header includes CUDA, cuBLAS, fmt, nlohmann-json or Eigen, no internal header
# is installed, and no compile line of the consumer names their include directories.
# Run by ctest (tests/CMakeLists.txt) with -D for every variable below.
#   LINTAPE_BUILD  the lintape build folder        WORK        a scratch folder (emptied first)
#   CONSUMER_SRC   tests/consumer                  GENERATOR   CMake generator of the lintape build
#   CXX            the C++ compiler                CXX_FLAGS   extra flags (the sanitizers' when on)
#   BUILD_TYPE     the lintape build type          README      README.md, whose ```cpp blocks are built
cmake_minimum_required(VERSION 3.25)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(prefix "${WORK}/prefix")

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  WORKING_DIRECTORY "${WORK}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

step("install" ${CMAKE_COMMAND} --install "${LINTAPE_BUILD}" --prefix "${prefix}")

# The installed headers: public ones only, none reaching for a dependency's header.
file(GLOB_RECURSE headers RELATIVE "${prefix}/include" "${prefix}/include/*")
foreach(header ${headers})
  if(header MATCHES "_cuda\\.h$|\\.cuh$|/core/(cuda|kernels|strided)\\.h$")
    message(FATAL_ERROR "consumer test: internal header installed: ${header}")
  endif()
  file(STRINGS "${prefix}/include/${header}" bad REGEX "#include *[<\"](cuda|cublas|fmt/|nlohmann/|Eigen/)")
  if(bad)
    message(FATAL_ERROR "consumer test: ${header} includes a dependency's header: ${bad}")
  endif()
endforeach()
if(NOT "lintape/lintape.h" IN_LIST headers)
  message(FATAL_ERROR "consumer test: the umbrella header lintape/lintape.h is not installed")
endif()

# The README's C++ examples, one file each.
file(READ "${README}" readme)
string(REPLACE ";" "<semicolon>" readme "${readme}")  # a CMake list separator otherwise
string(REGEX MATCHALL "```cpp\n[^`]*```" blocks "${readme}")
list(LENGTH blocks example_count)
if(example_count LESS 2)
  message(FATAL_ERROR "consumer test: expected the README's two C++ examples; found ${example_count}")
endif()
set(index 0)
foreach(block ${blocks})
  math(EXPR index "${index} + 1")
  string(REGEX REPLACE "^```cpp\n|```$" "" code "${block}")
  string(REPLACE "<semicolon>" ";" code "${code}")
  file(WRITE "${WORK}/readme/readme_example_${index}.cpp" "${code}")
endforeach()

step("configure" ${CMAKE_COMMAND} -S "${CONSUMER_SRC}" -B "${WORK}/build" -G "${GENERATOR}"
     "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_CXX_COMPILER=${CXX}" "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
     "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}" "-DREADME_EXAMPLES=${WORK}/readme")
step("build" ${CMAKE_COMMAND} --build "${WORK}/build")

# The compile lines name lintape's include directory and none of its dependencies'.
# (The prefix is set aside first: its own path may contain any of those words.)
file(READ "${WORK}/build/compile_commands.json" commands)
string(REPLACE "${prefix}/include" "<prefix>/include" commands "${commands}")
if(NOT commands MATCHES "-(I|isystem) *<prefix>/include")
  message(FATAL_ERROR "consumer test: ${prefix}/include is not on the compile line:\n${commands}")
endif()
string(TOLOWER "${commands}" commands_lower)
string(REGEX MATCHALL "-(i|isystem) *[^ \"]*(cuda|cublas|fmt|nlohmann|eigen)[^ \"]*" dep_includes "${commands_lower}")
if(dep_includes)
  message(FATAL_ERROR "consumer test: a dependency's include directory is on the compile line: ${dep_includes}")
endif()

step("run" "${WORK}/build/consumer" "${WORK}")
message("${step_output}")
if(NOT step_output MATCHES "loss 14 grad 2 4 6 loaded 6 lrpe \\(1, 5, 2, 8\\)")
  message(FATAL_ERROR "consumer test: unexpected output '${step_output}'")
endif()
foreach(i RANGE 1 ${example_count})
  step("README example ${i}" "${WORK}/build/readme_example_${i}")
  message("README example ${i}: ${step_output}")
endforeach()
