// BPE training on the pre-token counts of a PretokenCounter (Python: lmforge.tokenizer.training).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/counter.h"

namespace lmforge {

// Learn up to num_merges merges: repeatedly merge the most frequent adjacent pair (counted with
// pre-token multiplicity); ties go to the greatest (left bytes, right bytes). Tokens are identified
// by their bytes, as in the Python reference. progress(k) is called now and then with the number
// of merges done so far. Returns the merges as byte-string pairs in creation order.
std::vector<std::pair<std::string, std::string>> train_bpe(const PretokenCounter& counter, long long num_merges,
                                                           const std::function<void(long long)>& progress);

}  // namespace lmforge
