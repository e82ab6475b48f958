// Documents: cu_seqlens to per-token starts and back, and the errors for malformed boundaries.
#include "helpers.h"
#include "ops/documents.h"

using namespace lintape;
using lintape::test::check_throws_containing;

TEST_CASE("documents: cu_seqlens gives each token its document's start in the row") {
  // Two rows of 5: [3 | 2] and [1 | 4].
  const Documents docs = Documents::from_cu_seqlens({0, 3, 5, 6, 10}, 2, 5);
  REQUIRE(docs.defined());
  CHECK(docs.batch() == 2);
  CHECK(docs.seq_len() == 5);
  CHECK(docs.host_starts() == std::vector<int32_t>{0, 0, 0, 3, 3, 0, 1, 1, 1, 1});
  CHECK(documents_cu_seqlens(docs, 2, 5) == std::vector<int64_t>{0, 3, 5, 6, 10});
  const Documents again = Documents::from_starts(docs.starts());
  CHECK(again.host_starts() == docs.host_starts());
  CHECK(documents_cu_seqlens(Documents(), 3, 4) == std::vector<int64_t>{0, 4, 8, 12});
  // One token per document.
  CHECK(Documents::from_cu_seqlens({0, 1, 2, 3}, 1, 3).host_starts() == std::vector<int32_t>{0, 1, 2});
}

TEST_CASE("documents: the mean causal context counts each token's place in its document") {
  // Places 0 1 2 0 1 | 0 0 1 2 3: their sum 10, plus a half each, over 10 tokens.
  CHECK(mean_causal_context(Documents::from_cu_seqlens({0, 3, 5, 6, 10}, 2, 5), 5) == 1.5);
  // Rows of one document: N / 2, with or without the boundaries given.
  CHECK(mean_causal_context(Documents(), 5) == 2.5);
  CHECK(mean_causal_context(Documents::from_cu_seqlens({0, 5, 10}, 2, 5), 5) == 2.5);
  CHECK(mean_causal_context(Documents::from_cu_seqlens({0, 1, 2, 3}, 1, 3), 3) == 0.5);
}

TEST_CASE("documents: malformed boundaries are refused, naming what is wrong") {
  check_throws_containing([] { Documents::from_cu_seqlens({1, 4}, 1, 4); }, {"start at 0"});
  check_throws_containing([] { Documents::from_cu_seqlens({0, 3}, 1, 4); }, {"end at batch x seq_len = 4"});
  check_throws_containing([] { Documents::from_cu_seqlens({0, 2, 2, 4}, 1, 4); }, {"increase strictly"});
  check_throws_containing([] { Documents::from_cu_seqlens({0, 3, 8}, 2, 4); }, {"lacks the row start 4"});
  check_throws_containing([] { Documents::from_starts(from_vector({0, 0, 1}, {1, 3}, DType::I32)); },
                          {"starts[0, 2] = 1"});
  check_throws_containing([] { Documents::from_starts(from_vector({1, 1}, {1, 2}, DType::I32)); },
                          {"starts[0, 0] = 1"});
  const Documents docs = Documents::from_cu_seqlens({0, 2, 4}, 1, 4);
  check_throws_containing([&] { docs.check("fal", 1, 5, Device::cpu()); }, {"documents are for (1, 4) tokens"});
}
