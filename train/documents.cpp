#include "train/documents.h"

#include <algorithm>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "train/data.h"

namespace lintape {

namespace {

// "\n", "\t" and "\\" in a --documents value stand for a newline, a tab and a backslash.
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == 'n' || s[i + 1] == 't' || s[i + 1] == '\\')) {
      out += s[i + 1] == 'n' ? '\n' : s[i + 1] == 't' ? '\t' : '\\';
      ++i;
    } else {
      out += s[i];
    }
  }
  return out;
}

// A line without its newline (and a DOS carriage return).
std::string line_body(const std::string& text, size_t begin, size_t end) {
  if (end > begin && text[end - 1] == '\r') --end;
  return text.substr(begin, end - begin);
}

bool has_percent_line(const std::string& text) {
  for (size_t begin = 0; begin < text.size();) {
    const size_t nl = text.find('\n', begin), end = nl == std::string::npos ? text.size() : nl;
    if (line_body(text, begin, end) == "%") return true;
    begin = end + 1;
  }
  return false;
}

// Cut at the lines for which is_separator(body) holds; the document keeps its other lines whole.
template <class IsSeparator>
std::vector<std::string> split_lines(const std::string& text, IsSeparator is_separator) {
  std::vector<std::string> docs(1);
  for (size_t begin = 0; begin < text.size();) {
    const size_t nl = text.find('\n', begin), end = nl == std::string::npos ? text.size() : nl + 1;
    if (is_separator(line_body(text, begin, nl == std::string::npos ? end : nl))) {
      if (!docs.back().empty()) docs.emplace_back();
    } else {
      docs.back().append(text, begin, end - begin);
    }
    begin = end;
  }
  if (docs.back().empty()) docs.pop_back();
  return docs;
}

std::vector<std::string> split_at(const std::string& text, const std::string& separator) {
  std::vector<std::string> docs;
  size_t begin = 0;
  for (size_t at = text.find(separator); at != std::string::npos; at = text.find(separator, begin)) {
    if (at > begin) docs.push_back(text.substr(begin, at - begin));
    begin = at + separator.size();
  }
  if (begin < text.size()) docs.push_back(text.substr(begin));
  return docs;
}

std::vector<std::string> split_resolved(const std::string& text, const std::string& separator, bool percent) {
  if (separator != "auto") return split_at(text, unescape(separator));
  if (percent) return split_lines(text, [](const std::string& line) { return line == "%"; });
  return split_lines(text, [](const std::string& line) {
    return line.find_first_not_of(" \t") == std::string::npos;  // empty, or only blanks
  });
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LT_CHECK(in.good(), "[data] cannot read the data file '", path, "'");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

int64_t TokenText::documents() const {
  if (first.empty()) return 1;
  return int64_t(std::count(first.begin(), first.end(), uint8_t(1)));
}

std::vector<std::string> split_text(const std::string& text, const std::string& separator) {
  LT_CHECK(!separator.empty(), "[data] --documents: the separator must not be empty");
  return split_resolved(text, separator, has_percent_line(text));
}

TokenText split_tokens(std::vector<int32_t> tokens, int64_t eot_token, const std::string& source) {
  TokenText t;
  t.first.resize(tokens.size(), 0);
  int64_t found = 0;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (int64_t(tokens[i]) == eot_token) {
      t.first[i] = 1;
      ++found;
    }
  LT_CHECK(found > 0, "[data] --documents: '", source, "' holds no end-of-text token ", eot_token,
           " to cut its documents at (--eot-token sets it)");
  if (!t.first.empty()) t.first[0] = 1;
  t.tokens = std::move(tokens);
  return t;
}

TokenText load_documents(const std::string& path, const DocumentSplit& split, int64_t vocab,
                         std::string* description) {
  LT_CHECK(split.on(), "[data] load_documents needs a --documents separator");
  if (is_llmc_bin(path)) {
    LT_CHECK(split.separator == "auto", "[data] --documents=", split.separator, ": '", path,
             "' is an llm.c token file, cut at an end-of-text token (--eot-token), not at a separator; give "
             "--documents alone");
    if (description) *description = "end-of-text token " + std::to_string(split.eot_token);
    return split_tokens(load_tokens(path, vocab), split.eot_token, path);
  }
  std::vector<std::string> texts;
  for (const std::string& file : data_files(path)) {
    LT_CHECK(!is_llmc_bin(file), "[data] --documents: the directory '", path, "' holds the llm.c file '", file,
             "'; give it as --data itself");
    texts.push_back(read_bytes(file));
  }
  const bool percent = split.separator == "auto" && std::any_of(texts.begin(), texts.end(), has_percent_line);
  if (description)
    *description = split.separator != "auto" ? "\"" + split.separator + "\""
                   : percent                 ? "the fortunes' % lines"
                                             : "blank lines";
  TokenText t;
  for (const std::string& text : texts)
    for (const std::string& doc : split_resolved(text, split.separator, percent)) {
      t.first.push_back(1);
      t.first.insert(t.first.end(), doc.size() - 1, 0);
      for (char c : doc) t.tokens.push_back(int32_t(static_cast<unsigned char>(c)));
    }
  LT_CHECK(!t.tokens.empty(), "[data] --documents: '", path, "' holds no document (only separators)");
  // Bytes: only a vocabulary below 256 can be too small for them.
  const auto big = std::find_if(t.tokens.begin(), t.tokens.end(), [&](int32_t v) { return vocab > 0 && v >= vocab; });
  LT_CHECK(big == t.tokens.end(), "[data] '", path, "' holds byte ", big == t.tokens.end() ? 0 : *big,
           "; the model's vocabulary has ", vocab, " tokens (0..", vocab - 1, ")");
  return t;
}

TokenText tail(const TokenText& text, size_t from) {
  TokenText t;
  t.tokens.assign(text.tokens.begin() + std::ptrdiff_t(from), text.tokens.end());
  if (!text.first.empty()) {
    t.first.assign(text.first.begin() + std::ptrdiff_t(from), text.first.end());
    if (!t.first.empty()) t.first[0] = 1;
  }
  return t;
}

}  // namespace lintape
