// The lintape command-line tool. This is the one place that decides the exit status:
//   0 success, 1 an error while working (lintape::Error, the OS's, out of memory), 2 a usage error
//   (CLI11's parse errors and cli::UsageError), for every subcommand.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>
#include <CLI/CLI.hpp>
#include "cli/commands.h"

namespace {

constexpr int kUsageError = 2;

int usage_error(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "error: %s\nRun with --help for more information.\n", message.c_str());
  return kUsageError;
}

// The first word that is not an option names the subcommand (the app itself takes no option values).
const char* subcommand_word(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return argv[i];
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lintape::cli;
  CLI::App app{"lintape: a tensor library with tape autograd and fused linear-attention ops", "lintape"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "Print the version and the build (CUDA, architectures) and exit");
  const std::vector<Command> commands = {add_train_command(app), add_eval_command(app), add_generate_command(app),
                                         add_profile_command(app),
                                         add_info_command(app), add_bench_command(app)};

  std::string names;
  bool known = false;
  const char* word = subcommand_word(argc, argv);
  for (const Command& c : commands) {
    names += (names.empty() ? "" : ", ") + c.app->get_name();
    known = known || (word && c.app->get_name() == word);
  }
  if (word && !known)
    return usage_error(std::string("unknown subcommand '") + word + "'; the subcommands are " + names);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return usage_error(e.what());
  }
  if (version) {
    std::printf("%s\n", version_string().c_str());
    return 0;
  }

  try {
    for (const Command& c : commands)
      if (c.app->parsed()) {
        c.run();
        return 0;
      }
  } catch (const ExitStatus& e) {
    std::fflush(stdout);
    return e.status;
  } catch (const UsageError& e) {
    return usage_error(e.what());
  } catch (const std::exception& e) {  // lintape::Error, and the standard library's (bad_alloc, ...)
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  // No subcommand: the help, as a usage error.
  std::printf("%s", app.help().c_str());
  return kUsageError;
}
