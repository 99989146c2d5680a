// Uncertainty statistics for CHESS re-selection (CHESS §3.3, §5.1, Figure 4).
//
// Per token, from next-token logits z (length V): p = softmax(z),
//   entropy     H = -sum p ln p                      (nats),
//   varentropy  V = sum p (ln p + H)^2 = Var_p(z)    (nats^2).
// Both come from one pass over the row after its maximum m (two reads of a
// row that stays in cache): with x = z - m, s = sum e^x, s1 = sum e^x x,
// s2 = sum e^x x^2, H = ln s - s1/s and V = s2/s - (s1/s)^2. The exponential
// is evaluated in base 2 on 16-lane vectors (relative error ~1e-7) with
// exponents clamped at -126, so a masked -inf logit weighs 2^-126 (nothing
// next to the maximum's 1); NaN and +inf are errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvcal {

struct TokenStats {
  double entropy = 0;
  double varentropy = 0;
};

// Statistics of one row of V float logits. Throws kvcal::Error for V = 0, a
// NaN or +inf entry, or a row that is entirely -inf.
TokenStats token_stats(const float* logits, std::int64_t v);

// Rows [rows, v] (row-major), threaded over rows; entropy/varentropy get `rows`
// values each. On a bad row, throws kvcal::Error naming its position
// (first_position + row).
void token_stats_rows(const float* logits, std::int64_t rows, std::int64_t v, double* entropy, double* varentropy,
                      int threads = 0, std::int64_t first_position = 0);

// How a page's varentropy is defined (the CHESS paper does not say).
enum class PageVarentropy { mean, temporal };
const char* to_string(PageVarentropy p);
PageVarentropy parse_page_varentropy(const std::string& name);  // throws kvcal::Error

enum class TriggerRule { both, either };  // "and", "or"
const char* to_string(TriggerRule r);
TriggerRule parse_trigger_rule(const std::string& name);  // throws kvcal::Error

struct PageOptions {
  std::int64_t page_size = 32;
  PageVarentropy varentropy = PageVarentropy::mean;
  bool keep_partial = false;  // a last page with fewer than page_size tokens
};

// Page statistics of one sequence: mean token entropy per page, and page
// varentropy (mean of token varentropies, or the population variance of token
// entropy within the page). Appends one value per page to the outputs.
void page_stats(const std::vector<double>& entropy, const std::vector<double>& varentropy, const PageOptions& options,
                std::vector<double>& page_entropy, std::vector<double>& page_varentropy);

// The q-th percentile (q in [0, 100]) with linear interpolation between
// closest ranks (NumPy's default). Requires a non-empty input.
double percentile(std::vector<double> values, double q);

}  // namespace kvcal
