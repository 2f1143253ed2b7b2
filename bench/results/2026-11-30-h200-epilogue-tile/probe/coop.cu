#include "variant.cuh"
namespace exp_epi {
template struct Variant<128, 256, false, 1, 1, 0, 0>;
template struct Variant<128, 256, false, 1, 1, 128, 64>;
}
