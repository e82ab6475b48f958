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
expect(2 "--no-cuda-graph applies to bench train only" bench copy --device cpu --no-cuda-graph)
expect(2 "--cuda-graph needs a CUDA device; got cpu" bench copy --device cpu --cuda-graph)
expect(2 "bench train replays its step as a CUDA graph already" bench train --device cpu --cuda-graph)
# On the CPU the step is never a graph: --no-cuda-graph is accepted and the table is the same.
expect(0 "tokens/s +ms/step +MFU.*\n +[0-9]+ +[0-9.]+ +n/a" bench train --device cpu --preset tiny --batch 1 --seq 32
       --vocab 256 --steps 1 --warmup 0 --no-cuda-graph)
expect(0 "fal +3 .*tpa +1 .*optimizer .*sum of the parts [0-9.]+ ms; a whole step timed alone.*by op .*fwd ms +bwd ms .*fal +fal +3 +[0-9.]+ +[0-9.]+ +[0-9.]+%" profile --device cpu
       --preset tiny --batch 1 --seq 32 --vocab 256 --steps 1 --warmup 0)
expect(2 "--preset: huge not in" profile --device cpu --preset huge)
expect(0 "batch 2 x 32, documents of 8 tokens.*fal +3 .*tpa +1 .*sum of the parts" profile --device cpu --preset tiny
       --batch 2 --seq 32 --vocab 256 --steps 1 --warmup 0 --documents 8)

# Zero, negative and absurd values: a usage error naming the option and the value (no 300-digit range).
expect(2 "--steps: must be positive; got 0" train --device cpu --steps 0)
expect(2 "--batch: must be positive; got 0" train --device cpu --batch 0 --seq 0 --lr 0 --checkpoint-every -3)
expect(2 "--checkpoint-every: must not be negative; got -3" train --device cpu --checkpoint-every -3)
expect(2 "--lr: must be positive; got 0" train --device cpu --lr 0)
expect(2 "--temperature: must not be negative; got -1" generate --checkpoint x --prompt a --temperature -1)
expect(2 "--top-k: must not be negative; got -3" generate --checkpoint x --prompt a --top-k -3)
expect(2 "--steps: must be positive; got 0" profile --device cpu --steps 0)
expect(2 "batch x seq_len overflows.*--batch 1152921504606846976" train --device cpu --data mqar --steps 1
       --batch 1152921504606846976)
expect(2 "batch x seq_len overflows.*--seq 2305843009213693952" train --device cpu --data mqar --steps 1
       --seq 2305843009213693952)
expect(2 "batch 1000000000 x seq_len 256 would need at least [0-9]+ bytes" train --device cpu --data mqar --steps 1
       --batch 1000000000)
file(WRITE "${WORK}/big.json" "{\"model\": {\"width\": 100000000}}")
expect(1 "big.json: .*would need [0-9]+ bytes" train --device cpu --config "${WORK}/big.json")
# --help shows the defaults.
expect(0 "--temperature FLOAT[^\n]*0\\.8.*--top-k INT[^\n]*0" generate --help)  # CLI11 2.1: =0.8, 2.4: [0.8]
expect(0 "--steps.*default: the preset's.*--checkpoint-every.*default 0" train --help)

# --resume: options that differ from the checkpoint's are refused naming its value; --steps extends the run.
expect(0 "2 steps of 2 x 32 tokens" train --device cpu --data mqar --steps 2 --batch 2 --seq 32
       --checkpoint-dir "${WORK}/ck")
expect(2 "--batch 4 differs from the checkpoint's 2" train --device cpu --resume --checkpoint-dir "${WORK}/ck"
       --batch 4)
expect(2 "--seq 64 differs from the checkpoint's 32" train --device cpu --resume --checkpoint-dir "${WORK}/ck" --seq 64)
expect(2 "--lr 0.1 differs from the checkpoint's 0.003" train --device cpu --resume --checkpoint-dir "${WORK}/ck"
       --lr 0.1)
expect(2 "--data README differs from the checkpoint's mqar" train --device cpu --resume --checkpoint-dir "${WORK}/ck"
       --data README)
expect(2 "--steps 1 is below the checkpoint's total of 2 steps" train --device cpu --resume
       --checkpoint-dir "${WORK}/ck" --steps 1)
expect(0 "3 steps of 2 x 32 tokens.*step 3/3" train --device cpu --resume --checkpoint-dir "${WORK}/ck" --steps 3)
# The last good checkpoint loads after every refusal.
file(WRITE "${WORK}/text.txt"
     "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.")
expect(0 "mean loss [0-9.]+" eval --checkpoint "${WORK}/ck" --data "${WORK}/text.txt" --batches 1)
# An edited state.json is refused naming it.
file(READ "${WORK}/ck/step_00000003/state.json" state)
string(REGEX REPLACE "\"layers\": [0-9]+" "\"layers\": 1099511627776" edited "${state}")
file(WRITE "${WORK}/ck/step_00000003/state.json" "${edited}")
expect(1 "state.json' was edited or corrupted" eval --checkpoint "${WORK}/ck" --data "${WORK}/text.txt")
file(WRITE "${WORK}/ck/step_00000003/state.json" "${state}")

# --documents: refused where it does not apply, recorded in the checkpoint, followed by eval.
expect(2 "--documents does not apply to mqar" train --device cpu --data mqar --steps 1 --documents)
expect(2 "--eot-token needs --documents" train --device cpu --data "${WORK}/text.txt" --steps 1 --eot-token 3)
expect(2 "--eot-token applies to llm.c .bin data" train --device cpu --data "${WORK}/text.txt" --steps 1
       --documents --eot-token 3)
expect(2 "--documents=<eos>: .*x.bin' is an llm.c token file.*--documents alone" train --device cpu
       --data "${WORK}/x.bin" --steps 1 --documents=<eos>)
string(REPEAT "a stitch in time saves nine.\n%\nthe quick brown fox jumps over the lazy dog.\n%\n" 20 sayings)
file(WRITE "${WORK}/sayings" "${sayings}")
expect(0 "rows packed from documents cut at the fortunes' % lines: 38 documents.*step 2/2" train --device cpu
       --data "${WORK}/sayings" --documents --steps 2 --batch 2 --seq 32 --checkpoint-dir "${WORK}/ck_docs")
expect(2 "--documents off differs from the checkpoint's auto" train --device cpu --resume
       --checkpoint-dir "${WORK}/ck_docs" --documents=off)
expect(0 "mean loss [0-9.]+, .*, documents cut at the fortunes' % lines" eval --checkpoint "${WORK}/ck_docs"
       --data "${WORK}/sayings" --batches 1)
expect(0 "mean loss [0-9.]+, perplexity [0-9.]+ over 1 sequences of 32 tokens\n" eval
       --checkpoint "${WORK}/ck_docs" --data "${WORK}/sayings" --batches 1 --documents=off)

# A long prompt on the CPU says it will take a while.
string(REPEAT "a" 2000 long_prompt)
expect(0 "a 2000-byte prompt on the CPU takes a while" generate --device cpu --checkpoint "${WORK}/ck"
       --prompt "${long_prompt}" --tokens 1)

# A short --val-data is refused naming the file, before training.
file(WRITE "${WORK}/short.txt" "short")
expect(1 "validation file .*short.txt' has 5 tokens" train --device cpu --data "${WORK}/text.txt" --seq 16
       --val-data "${WORK}/short.txt")

# An unwritable --checkpoint-dir is found before the first step (a file stands where the folder would be).
file(WRITE "${WORK}/a_file" "x")
expect(1 "cannot create the checkpoint directory .*a_file/ck" train --device cpu --data mqar --steps 1 --batch 1
       --seq 32 --checkpoint-dir "${WORK}/a_file/ck")
if(last_output MATCHES "step 1/1")
  message(SEND_ERROR "the checkpoint directory was checked only after training:\n${last_output}")
endif()

# A diverging run (--lr 1e30) stops at the NaN and writes no checkpoint from it: the latest stays the earlier
# run's, and it evaluates.
expect(0 "2 steps of 2 x 32 tokens" train --device cpu --data mqar --steps 2 --batch 2 --seq 32
       --checkpoint-dir "${WORK}/nan")
expect(1 "the weights after step 1 give a loss of -?nan on its batch; no checkpoint written from them, the latest in"
       train --device cpu --data mqar --steps 3 --batch 2 --seq 32 --lr 1e30 --checkpoint-every 1
       --checkpoint-dir "${WORK}/nan")
file(READ "${WORK}/nan/latest" latest)
string(STRIP "${latest}" latest)
if(NOT latest STREQUAL "step_00000002")
  message(SEND_ERROR "a diverged run replaced the last good checkpoint: latest is '${latest}'")
endif()
expect(0 "mean loss [0-9.]+" eval --checkpoint "${WORK}/nan" --data "${WORK}/text.txt" --batches 1)
expect(1 "the loss is -?nan at step 2; stopped before the update" train --device cpu --data mqar --steps 3 --batch 2
       --seq 32 --lr 1e30)

# Progress: the first step's line comes at once, the ETA in hours and minutes; data too short for a held-out
# batch says so once and logs no val_loss.
expect(0 "step 1/30 .* ETA [0-9]+ s\nstep 10/30" train --device cpu --data mqar --steps 30 --batch 1 --seq 16)
expect(0 "no validation data.*step 1/1 " train --device cpu --data "${WORK}/text.txt" --steps 1 --batch 1 --seq 16
       --log "${WORK}/noval.jsonl")
if(last_output MATCHES "val_loss")
  message(SEND_ERROR "val_loss printed without validation data:\n${last_output}")
endif()
file(READ "${WORK}/noval.jsonl" noval)
if(noval MATCHES "val_loss")
  message(SEND_ERROR "val_loss logged without validation data:\n${noval}")
endif()

# A token beyond the model's vocabulary is refused naming the file, the token and the vocabulary.
file(WRITE "${WORK}/vocab100.json"
     "{\"data\": \"${WORK}/text.txt\", \"model\": {\"vocab_size\": 100, \"seq_len\": 16}}")
expect(1 "text.txt' holds token 116 at position 0; the model's vocabulary has 100 tokens" train --device cpu
       --config "${WORK}/vocab100.json" --steps 1 --batch 1)

# SIGTERM and SIGINT: the step ends, a checkpoint is written and the exit status is 128 + the signal (143,
# 130). The run waits for its first JSONL row (at most a minute) before the signal; it ends within 2 minutes.
foreach(signal_status TERM:143 INT:130)
  string(REPLACE ":" ";" pair "${signal_status}")
  list(GET pair 0 signal)
  list(GET pair 1 status)
  set(dir "${WORK}/sig${signal}")
  execute_process(
    COMMAND sh -c "\"$0\" train --device cpu --data mqar --steps 1000000 --batch 2 --seq 32 --checkpoint-dir \"$1\" \
--log \"$1.jsonl\" > \"$1.out\" 2>&1 & pid=$!; i=0; \
while [ ! -s \"$1.jsonl\" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done; \
kill -$2 $pid; wait $pid; echo $?" "${LINTAPE}" "${dir}" "${signal}"
    OUTPUT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE TIMEOUT 120)
  file(READ "${dir}.out" out)
  if(NOT rc STREQUAL "${status}" OR NOT out MATCHES "SIG${signal} at step [0-9]+; checkpoint written to")
    message(SEND_ERROR "train stopped by SIG${signal}: expected status ${status} and a checkpoint; got ${rc}:\n${out}")
  else()
    message(STATUS "ok (${rc}): train stopped by SIG${signal}")
  endif()
  expect(0 "mean loss [0-9.]+" eval --checkpoint "${dir}" --data "${WORK}/text.txt" --batches 1)
endforeach()
