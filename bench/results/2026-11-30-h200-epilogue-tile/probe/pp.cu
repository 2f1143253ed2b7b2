#include "variant.cuh"
namespace exp_epi {
template struct Variant<128, 128, true, 1, 2, 0, 0>;
template struct Variant<128, 128, true, 1, 2, 64, 64>;
template struct Variant<128, 128, true, 1, 2, 64, 128>;
}
