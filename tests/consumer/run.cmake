# Installs the built lintape into a fresh prefix, builds tests/consumer against it, runs it and checks
# its output. Run by ctest (tests/CMakeLists.txt) with -D for every variable below.
#   LINTAPE_BUILD  the lintape build folder        WORK        a scratch folder (emptied first)
#   CONSUMER_SRC   tests/consumer                  GENERATOR   CMake generator of the lintape build
#   CXX            the C++ compiler                CXX_FLAGS   extra flags (the sanitizers' when on)
#   BUILD_TYPE     the lintape build type
file(REMOVE_RECURSE "${WORK}")
set(prefix "${WORK}/prefix")

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

step("install" ${CMAKE_COMMAND} --install "${LINTAPE_BUILD}" --prefix "${prefix}")
step("configure" ${CMAKE_COMMAND} -S "${CONSUMER_SRC}" -B "${WORK}/build" -G "${GENERATOR}"
     "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_CXX_COMPILER=${CXX}" "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
     "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
step("build" ${CMAKE_COMMAND} --build "${WORK}/build")
step("run" "${WORK}/build/consumer" "${WORK}")
message("${step_output}")
if(NOT step_output MATCHES "loss 14 grad 2 4 6 loaded 6")
  message(FATAL_ERROR "consumer test: unexpected output '${step_output}'")
endif()
