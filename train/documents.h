// Training data made of documents (`--documents`): a text cut at a separator, an llm.c .bin file cut at an
// end-of-text token. The documents are kept in the corpus's order, concatenated, and marked by where each
// one starts; train/data.h cuts the rows from them and turns the starts inside each row into the rows'
// Documents (ops/documents.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lintape {

// GPT-2's <|endoftext|>: llm.c's .bin files of GPT-2 tokens put it before every document.
constexpr int64_t kGpt2EndOfText = 50256;

// How to cut a corpus into documents. `separator` empty: no documents (each row one stretch of the corpus);
// "auto": the fortunes' `%` lines when a line of the text is only `%`, else blank lines (a run of empty
// lines); any other string: every occurrence of it (\n, \t and \\ stand for a newline, a tab and a
// backslash). A .bin file is cut before each `eot_token`, which stays as its document's first token; it
// takes only "auto".
struct DocumentSplit {
  std::string separator;
  int64_t eot_token = kGpt2EndOfText;
  bool on() const { return !separator.empty(); }
};

// Tokens with their documents: first[i] is 1 where a document begins (first[0] is always 1); an empty
// `first` means no documents.
struct TokenText {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> first;
  int64_t documents() const;  // how many start here (1 without documents)
};

// The documents of a text, cut as DocumentSplit says (auto decided on this text alone), separators removed
// and empty documents dropped.
std::vector<std::string> split_text(const std::string& text, const std::string& separator);
// A .bin's token array cut before each eot token; throws, naming `source`, when it holds none.
TokenText split_tokens(std::vector<int32_t> tokens, int64_t eot_token, const std::string& source);

// A data file or directory (load_tokens' forms) cut into documents: each file of a directory on its own
// (a file ends a document), "auto" decided once for them all. `description` says how ("the fortunes' %
// lines", "blank lines", "\"<sep>\"", "end-of-text token 50256"). vocab > 0: tokens checked as load_tokens.
TokenText load_documents(const std::string& path, const DocumentSplit& split, int64_t vocab,
                         std::string* description = nullptr);

// The tail of `text` from token `from` on (its first token then starts a document): the held-out part.
TokenText tail(const TokenText& text, size_t from);

}  // namespace lintape
