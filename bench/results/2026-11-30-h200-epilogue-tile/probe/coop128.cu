#include "variant.cuh"
namespace exp_epi {
template struct Variant<128, 256, false, 1, 1, 128, 128>;
template struct Variant<128, 256, false, 2, 1, 128, 64>;
}
