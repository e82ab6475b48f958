// The `lintape` subcommands. Each command group lives in its own cli/<group>.cpp and adds itself to the
// app through one function declared here; main calls it once and runs the command when it was given.
// Adding a subcommand is one declaration here and one line in main.
#pragma once
#include <functional>
#include <stdexcept>
#include <string>
#include "core/device.h"

namespace CLI {
class App;
class Validator;
}
namespace lintape::bench {
struct TrainBenchOptions;
}

namespace lintape::cli {

// A wrong command line found after parsing (a bad value, a missing argument, an unknown name). main
// prints it as "error: <message>" with a pointer to --help and exits with status 2; errors while
// working (lintape::Error, the OS's) exit with status 1.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A command that ends with an exit status of its own after its output: `train` stopped by SIGINT or SIGTERM
// exits with the shell's 128 + the signal (130, 143) once its checkpoint is written. main returns it.
struct ExitStatus {
  int status;
};

// A subcommand added to the app, and what to do when the command line selected it.
struct Command {
  CLI::App* app = nullptr;
  std::function<void()> run;
};

Command add_info_command(CLI::App& app);   // cli/info.cpp
Command add_bench_command(CLI::App& app);  // cli/bench_command.cpp
Command add_train_command(CLI::App& app);     // cli/train_command.cpp
Command add_eval_command(CLI::App& app);      // cli/train_command.cpp
Command add_generate_command(CLI::App& app);  // cli/train_command.cpp
Command add_profile_command(CLI::App& app);   // cli/profile_command.cpp

// `lintape bench train` (cli/profile_command.cpp, beside `profile`: both time training steps).
void bench_train(bench::TrainBenchOptions options, const std::string& device, const std::string& json);

// A --device value: cpu, cuda, cuda:N; empty or "auto" picks cuda:0 when a GPU is present, else the
// CPU. A bad name or a device this machine lacks is a UsageError naming the value (cli/info.cpp).
Device device_option(const std::string& value);

// Option checks whose message names the value: "--steps: must be positive; got 0" (CLI11's own range
// validators print the double's 300-digit limit). A value that is not a number is left to the conversion.
CLI::Validator positive_number();
CLI::Validator non_negative_number();

// "lintape 0.1.0 (Release; CUDA on, architectures 90a)" or "... (Release; CUDA off)".
std::string version_string();

}  // namespace lintape::cli
