// lmforge._core: the C++ hot paths of the tokenizer (placeholder module entry; filled by the tokenizer work).
#include <nanobind/nanobind.h>
namespace nb = nanobind;
NB_MODULE(_core, m) {
    m.doc() = "lmforge C++ core: pre-tokenization, BPE training and encoding";
    m.attr("ABI_VERSION") = 1;
}
