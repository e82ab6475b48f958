# The `lintape` tool's command line: exit statuses (0 success, 1 an error while working, 2 a usage
# error) and the key words of its messages. Run by ctest as
#   cmake -DLINTAPE=<path of the tool> -DWORK=<scratch folder> -P run_cli.cmake

set(failures 0)

# expect(<status> <regex the output must match> <arguments...>): stdout and stderr are matched together.
function(expect status pattern)
  execute_process(COMMAND ${LINTAPE} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(all "${out}${err}")
  list(JOIN ARGN " " words)
  if(NOT rc STREQUAL "${status}" OR NOT all MATCHES "${pattern}")
    message(SEND_ERROR "lintape ${words}: expected status ${status} and output matching '${pattern}'; "
                       "got status ${rc} and:\n${all}")
  else()
    message(STATUS "ok (${rc}): lintape ${words}")
  endif()
  set(last_output "${all}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

expect(2 "Usage: lintape.*Subcommands:.*bench")                          # no arguments: the help
expect(2 "unknown subcommand 'benhc'.*info, bench" benhc)
expect(0 "^lintape [0-9]+\\.[0-9]+\\.[0-9]+ \\([A-Za-z]*; CUDA (on, architectures [0-9]|off)" --version)
expect(0 "Usage: lintape bench" bench --help)
expect(2 "--reps: must be >= 1; got 0" bench copy --device cpu --reps 0)
if(last_output MATCHES "[0-9]{20}")
  message(SEND_ERROR "--reps 0 prints a huge number:\n${last_output}")
endif()
expect(2 "--n takes positive integers.*'-256'" bench copy --device cpu --n -256)
expect(2 "unknown benchmark 'nosuch'" bench nosuch --device cpu)
expect(2 "expects a benchmark name" bench)
expect(2 "--device gpu" bench copy --device gpu)

# An unwritable --json fails with the OS's reason before anything is measured (no table printed).
expect(1 "cannot write --json .*/missing/r.json: No such file or directory" bench copy --device cpu --quick
       --json "${WORK}/missing/r.json")
if(last_output MATCHES "copy bandwidth|copy-speed")
  message(SEND_ERROR "the --json path was checked only after measuring:\n${last_output}")
endif()

# A good run: units in the titles, n as an integer, the plots in FILE.plots/.
expect(0 "copy-speed-fwd-bf16 \\(ms\\):.*\n0 +64 .*copy-memory-fwd-bf16 \\(MiB\\):" bench copy --device cpu --quick
       --json "${WORK}/r.json")
foreach(plot copy-speed-fwd-bf16.svg copy-memory-fwd-bf16.svg)
  if(NOT EXISTS "${WORK}/r.json.plots/${plot}")
    message(SEND_ERROR "bench --json ${WORK}/r.json: no plot ${WORK}/r.json.plots/${plot}")
  endif()
endforeach()
file(GLOB loose "${WORK}/*.svg")
if(loose)
  message(SEND_ERROR "plots written beside the JSON file: ${loose}")
endif()
if(NOT EXISTS "${WORK}/r.json")
  message(SEND_ERROR "bench --json ${WORK}/r.json wrote no JSON")
endif()

# A run of several tables ends with the summary; matmul on the CPU speaks GFLOP/s.
expect(0 "GFLOP/s.*summary \\(ms\\).*matmul +fwd" bench matmul --device cpu --quick --metric speed --n 16)

# Training steps: `bench train` and `profile` on a small model on the CPU; their options are checked.
expect(0 "tokens/s +ms/step +MFU.*\n +[0-9]+ +[0-9.]+ +n/a" bench train --device cpu --preset tiny --batch 1 --seq 32
       --vocab 256 --steps 1 --warmup 0 --json "${WORK}/train.json")
if(NOT EXISTS "${WORK}/train.json")
  message(SEND_ERROR "bench train --json ${WORK}/train.json wrote no JSON")
endif()
expect(2 "--batch applies to bench train only" bench copy --device cpu --batch 4)
expect(0 "fal +3 .*tpa +1 .*optimizer .*sum of the parts [0-9.]+ ms; a whole step timed alone.*by op .*fwd ms +bwd ms .*fal +fal +3 +[0-9.]+ +[0-9.]+ +[0-9.]+%" profile --device cpu
       --preset tiny --batch 1 --seq 32 --vocab 256 --steps 1 --warmup 0)
expect(2 "--preset: huge not in" profile --device cpu --preset huge)
