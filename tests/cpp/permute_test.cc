// Tests of sort_by_expert, permute_rows, unpermute and gather_row_dots against naive loops,
// serial and on a parallel runner.

#include <gtest/gtest.h>

#include <climits>
#include <random>
#include <string>
#include <vector>

#include "nodrop/engine_cpu.h"
#include "test_util.h"

namespace {

using nodrop::DType;
using nodrop::Status;
using nodrop_test::Array;
using nodrop_test::Fenced;
using nodrop_test::first_nonzero;
using nodrop_test::Guarded;
using nodrop_test::kAllDtypes;
using nodrop_test::mentions;
using nodrop_test::random_array;
using nodrop_test::random_floats;
using nodrop_test::rel_error;
using nodrop_test::short_name;
using nodrop_test::ThreadRunner;
using nodrop_test::to_double;
using nodrop_test::tolerance;
using Ints = std::vector<int32_t>;

// ---- naive references ------------------------------------------------------------------------

struct Sorted {
  Ints row_map;  // [T*k]
  Ints sizes;    // [E]
};

// Stable counting sort of the flat (token, slot) index by expert; out-of-range ids are dropped.
Sorted naive_sort(const Ints& ids, int64_t E) {
  Sorted out{Ints(ids.size(), -1), Ints(E, 0)};
  for (int32_t id : ids)
    if (id >= 0 && id < E) ++out.sizes[id];
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + out.sizes[e - 1];
  for (size_t i = 0; i < ids.size(); ++i)  // i = t*k + s, so ties keep (token, slot) order
    if (ids[i] >= 0 && ids[i] < E) out.row_map[i] = next[ids[i]]++;
  return out;
}

bool in_rows(int32_t r, int64_t num_rows) { return r >= 0 && r < num_rows; }

// dst[T*k, H]: dst[row_map[i]] = w[i] * src[i / k]; unmapped rows zero.
std::vector<double> naive_scatter(const Array& src, const Ints& row_map, const float* w,
                                  int64_t T, int64_t k, int64_t H) {
  std::vector<double> dst(T * k * H, 0.0);
  for (int64_t i = 0; i < T * k; ++i) {
    if (!in_rows(row_map[i], T * k)) continue;
    for (int64_t h = 0; h < H; ++h)
      dst[row_map[i] * H + h] = (w ? w[i] : 1.0) * src.at((i / k) * H + h);
  }
  return dst;
}

// dst[T, H]: dst[t] = sum_s w[t*k+s] * src[row_map[t*k+s]].
std::vector<double> naive_gather(const Array& src, const Ints& row_map, const float* w, int64_t T,
                                 int64_t k, int64_t H) {
  std::vector<double> dst(T * H, 0.0);
  for (int64_t i = 0; i < T * k; ++i) {
    if (!in_rows(row_map[i], T * k)) continue;
    for (int64_t h = 0; h < H; ++h)
      dst[(i / k) * H + h] += (w ? w[i] : 1.0) * src.at(row_map[i] * H + h);
  }
  return dst;
}

// out[T*k]: out[t*k+s] = <a[t], rows[row_map[t*k+s]]>, zero when out of range.
std::vector<double> naive_row_dots(const Array& a, const Array& rows, const Ints& row_map,
                                   int64_t T, int64_t k, int64_t H) {
  std::vector<double> out(T * k, 0.0);
  for (int64_t i = 0; i < T * k; ++i) {
    if (!in_rows(row_map[i], T * k)) continue;
    for (int64_t h = 0; h < H; ++h) out[i] += a.at((i / k) * H + h) * rows.at(row_map[i] * H + h);
  }
  return out;
}

// Ids in [0, E), with about one slot in `drop_every` replaced by an out-of-range id.
Ints random_ids(int64_t T, int64_t k, int64_t E, std::mt19937& rng, int drop_every = 0) {
  std::uniform_int_distribution<int32_t> dist(0, E - 1);
  const Ints bad = {-1, static_cast<int32_t>(E), INT32_MIN, INT32_MAX};
  Ints ids(T * k);
  for (int64_t i = 0; i < T * k; ++i)
    ids[i] = (drop_every && i % drop_every == 1) ? bad[i % bad.size()] : dist(rng);
  return ids;
}

struct Shape {
  const char* name;
  int64_t T, k, E, H;
};
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> kShapes = {
      {"odd H=13", 37, 3, 8, 13},
      {"T=1 and k equal to E", 1, 4, 4, 7},
      {"k=1, one expert", 9, 1, 1, 5},
      {"wider rows", 64, 2, 5, 128},
  };
  return kShapes;
}

// ---- sort_by_expert --------------------------------------------------------------------------

struct SortResult {
  Status status;
  Ints row_map, sizes;
  bool canaries_intact;
};

SortResult run_sort(const Ints& ids, int64_t T, int64_t k, int64_t E, bool checked) {
  const Fenced ids_f(ids);  // a read past T*k ids crashes
  Guarded<int32_t> row_map(T * k, 12345), sizes(E, 12345);
  Status s = nodrop::cpu::sort_by_expert(ids_f.as<int32_t>(), T, k, E, checked, row_map.data(),
                                         sizes.data());
  return {s, row_map.vec(), sizes.vec(), row_map.canaries_intact() && sizes.canaries_intact()};
}

TEST(SortByExpert, OrdersRowsByExpertThenTokenThenSlot) {
  std::mt19937 rng(100);
  for (const Shape& sh : shapes()) {
    for (bool checked : {false, true}) {
      SCOPED_TRACE(std::string(sh.name) + (checked ? " checked" : ""));
      // Random ids may repeat inside a token: the order is still defined by (token, slot).
      const Ints ids = random_ids(sh.T, sh.k, sh.E, rng);
      const SortResult r = run_sort(ids, sh.T, sh.k, sh.E, checked);
      ASSERT_TRUE(r.status.ok()) << r.status.message();
      EXPECT_TRUE(r.canaries_intact);
      const Sorted want = naive_sort(ids, sh.E);
      EXPECT_EQ(r.row_map, want.row_map);
      EXPECT_EQ(r.sizes, want.sizes);
    }
  }
}

TEST(SortByExpert, TokenWithAllExpertsFillsEveryGroupOnce) {
  // T = 1, k = E: each expert gets exactly one row, and row e holds the slot that chose e.
  const Ints ids = {2, 0, 3, 1};
  const SortResult r = run_sort(ids, 1, 4, 4, false);
  ASSERT_TRUE(r.status.ok()) << r.status.message();
  EXPECT_EQ(r.row_map, (Ints{2, 0, 3, 1}));
  EXPECT_EQ(r.sizes, (Ints{1, 1, 1, 1}));
}

TEST(SortByExpert, NoTokensGiveEmptyGroups) {
  for (bool checked : {false, true}) {
    const SortResult r = run_sort({}, 0, 2, 3, checked);
    ASSERT_TRUE(r.status.ok()) << r.status.message();
    EXPECT_TRUE(r.canaries_intact);
    EXPECT_EQ(r.sizes, (Ints{0, 0, 0}));
  }
}

TEST(SortByExpert, UncheckedDropsOutOfRangeIds) {
  std::mt19937 rng(101);
  const int64_t T = 23, k = 3, E = 6;
  const Ints ids = random_ids(T, k, E, rng, /*drop_every=*/4);
  const SortResult r = run_sort(ids, T, k, E, false);
  ASSERT_TRUE(r.status.ok()) << r.status.message();
  EXPECT_TRUE(r.canaries_intact);
  const Sorted want = naive_sort(ids, E);
  EXPECT_EQ(r.row_map, want.row_map);  // -1 for each dropped slot
  EXPECT_EQ(r.sizes, want.sizes);      // dropped slots are counted nowhere
}

TEST(SortByExpert, CheckedRejectsOutOfRangeIdsNamingIds) {
  const int64_t T = 4, k = 2, E = 5;
  for (int32_t bad : {-1, 5, INT32_MIN, INT32_MAX}) {
    SCOPED_TRACE(bad);
    Ints ids = {0, 1, 2, 3, 4, 0, 1, 2};
    ids[5] = bad;
    const SortResult r = run_sort(ids, T, k, E, true);
    EXPECT_FALSE(r.status.ok());
    EXPECT_TRUE(mentions(r.status, "ids")) << r.status.message();
    EXPECT_TRUE(r.canaries_intact);
  }
}

// ---- permute_rows ----------------------------------------------------------------------------

// Row maps come from the naive sort (with dropped slots), so these tests do not depend on the
// engine's sort.
class PermuteRowsDtypes : public testing::TestWithParam<DType> {};

TEST_P(PermuteRowsDtypes, MatchesNaiveReferenceAndZeroesUnmappedRows) {
  const DType dtype = GetParam();
  std::mt19937 rng(200);
  for (const Shape& sh : shapes()) {
    for (bool weighted : {true, false}) {
      SCOPED_TRACE(std::string(sh.name) + (weighted ? " weighted" : ""));
      const int64_t T = sh.T, k = sh.k, H = sh.H;
      const Ints row_map = naive_sort(random_ids(T, k, sh.E, rng, 5), sh.E).row_map;
      const Array src = random_array(dtype, T * H, rng);
      const std::vector<float> w = random_floats(T * k, rng, 0.0, 1.0);
      Array dst(dtype, T * k * H);
      nodrop::cpu::permute_rows(src.data(), dtype, row_map.data(), weighted ? w.data() : nullptr,
                                T, k, H, dst.data());
      EXPECT_TRUE(dst.canaries_intact());
      const auto want = naive_scatter(src, row_map, weighted ? w.data() : nullptr, T, k, H);
      const auto got = dst.values();
      EXPECT_LE(rel_error(got, want), tolerance(dtype));
      std::vector<bool> mapped(T * k, false);
      for (int32_t r : row_map)
        if (r >= 0) mapped[r] = true;
      for (int64_t r = 0; r < T * k; ++r)
        if (!mapped[r]) EXPECT_EQ(first_nonzero(got, r * H, (r + 1) * H), -1) << "row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, PermuteRowsDtypes, testing::ValuesIn(kAllDtypes),
                         [](const testing::TestParamInfo<DType>& i) { return short_name(i.param); });

TEST(PermuteRows, WithoutWeightsCopiesRowsBitExactly) {
  std::mt19937 rng(201);
  const int64_t T = 11, k = 2, E = 4, H = 9;
  for (DType dtype : kAllDtypes) {
    const Ints row_map = naive_sort(random_ids(T, k, E, rng), E).row_map;
    const Array src = random_array(dtype, T * H, rng);
    Array dst(dtype, T * k * H);
    nodrop::cpu::permute_rows(src.data(), dtype, row_map.data(), nullptr, T, k, H, dst.data());
    for (int64_t i = 0; i < T * k; ++i)
      for (int64_t h = 0; h < H; ++h)
        ASSERT_EQ(dst.at(row_map[i] * H + h), src.at((i / k) * H + h)) << short_name(dtype);
  }
}

TEST(PermuteRows, SkipsRowMapEntriesOutsideTheRows) {
  // Entries -1, T*k, INT32_MIN, INT32_MAX must be skipped: nothing written outside dst, and the
  // rows they would have filled stay zero.
  const int64_t T = 4, k = 2, H = 5;
  const Ints row_map = {3, -1, 0, 8, INT32_MIN, 1, INT32_MAX, 2};
  std::mt19937 rng(202);
  for (DType dtype : kAllDtypes) {
    const Array src = random_array(dtype, T * H, rng);
    const std::vector<float> w = random_floats(T * k, rng, 0.5, 1.0);
    const Fenced src_f(src), map_f(row_map), w_f(w);
    Array dst(dtype, T * k * H);
    nodrop::cpu::permute_rows(src_f.data(), dtype, map_f.as<int32_t>(), w_f.as<float>(), T, k, H,
                              dst.data());
    EXPECT_TRUE(dst.canaries_intact());
    const auto got = dst.values();
    EXPECT_LE(rel_error(got, naive_scatter(src, row_map, w.data(), T, k, H)), tolerance(dtype));
    EXPECT_EQ(first_nonzero(got, 4 * H, T * k * H), -1) << "rows 4..7 are mapped by no slot";
  }
}

TEST(PermuteRows, NoTokensIsANoOp) {
  Array src(DType::kFloat32, 0), dst(DType::kFloat32, 0);
  nodrop::cpu::permute_rows(src.data(), DType::kFloat32, nullptr, nullptr, 0, 2, 8, dst.data());
  EXPECT_TRUE(dst.canaries_intact());
}

// ---- unpermute -------------------------------------------------------------------------------

class UnpermuteDtypes : public testing::TestWithParam<DType> {};

TEST_P(UnpermuteDtypes, MatchesNaiveReference) {
  const DType dtype = GetParam();
  std::mt19937 rng(300);
  for (const Shape& sh : shapes()) {
    for (bool weighted : {true, false}) {
      SCOPED_TRACE(std::string(sh.name) + (weighted ? " weighted" : ""));
      const int64_t T = sh.T, k = sh.k, H = sh.H;
      const Ints row_map = naive_sort(random_ids(T, k, sh.E, rng, 5), sh.E).row_map;
      const Array src = random_array(dtype, T * k * H, rng);
      const std::vector<float> w = random_floats(T * k, rng, -1.0, 1.0);
      Array dst(dtype, T * H);
      nodrop::cpu::unpermute(src.data(), dtype, row_map.data(), weighted ? w.data() : nullptr,
                             T, k, H, dst.data());
      EXPECT_TRUE(dst.canaries_intact());
      EXPECT_LE(rel_error(dst.values(),
                          naive_gather(src, row_map, weighted ? w.data() : nullptr, T, k, H)),
                tolerance(dtype));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, UnpermuteDtypes, testing::ValuesIn(kAllDtypes),
                         [](const testing::TestParamInfo<DType>& i) { return short_name(i.param); });

TEST(Unpermute, SkipsRowMapEntriesOutsideTheRows) {
  // Token 2 has only out-of-range entries: its row must be exactly zero.
  const int64_t T = 4, k = 2, H = 5;
  const Ints row_map = {3, -1, 0, 8, INT32_MIN, INT32_MAX, 1, 2};
  std::mt19937 rng(301);
  for (DType dtype : kAllDtypes) {
    const Array src = random_array(dtype, T * k * H, rng);
    const std::vector<float> w = random_floats(T * k, rng, 0.5, 1.0);
    const Fenced src_f(src), map_f(row_map), w_f(w);  // a read past any input crashes
    Array dst(dtype, T * H);
    nodrop::cpu::unpermute(src_f.data(), dtype, map_f.as<int32_t>(), w_f.as<float>(), T, k, H,
                           dst.data());
    EXPECT_TRUE(dst.canaries_intact());
    const auto got = dst.values();
    EXPECT_LE(rel_error(got, naive_gather(src, row_map, w.data(), T, k, H)), tolerance(dtype));
    EXPECT_EQ(first_nonzero(got, 2 * H, 3 * H), -1);
  }
}

TEST(Unpermute, AccumulatesHalfPrecisionInFloat32) {
  // 1 + tiny + tiny: each partial sum 1 + tiny rounds back to 1 in the storage type, but the
  // float32 sum 1 + 2*tiny is exactly representable there. tiny is half an ulp of 1.
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const double tiny = dtype == DType::kBFloat16 ? 0x1p-8 : 0x1p-11;
    const int64_t T = 1, k = 3, H = 1;
    Array src(dtype, 3);
    src.set(0, 1.0);
    src.set(1, tiny);
    src.set(2, tiny);
    const Ints row_map = {0, 1, 2};
    Array dst(dtype, 1);
    nodrop::cpu::unpermute(src.data(), dtype, row_map.data(), nullptr, T, k, H, dst.data());
    EXPECT_EQ(dst.at(0), 1.0 + 2 * tiny) << short_name(dtype);
  }
}

TEST(Unpermute, NoTokensIsANoOp) {
  Array src(DType::kBFloat16, 0), dst(DType::kBFloat16, 0);
  nodrop::cpu::unpermute(src.data(), DType::kBFloat16, nullptr, nullptr, 0, 3, 8, dst.data());
  EXPECT_TRUE(dst.canaries_intact());
}

// ---- gather_row_dots ---------------------------------------------------------------------------

class GatherRowDotsDtypes : public testing::TestWithParam<DType> {};

TEST_P(GatherRowDotsDtypes, MatchesNaiveReferenceAndZeroesOutOfRangeEntries) {
  const DType dtype = GetParam();
  std::mt19937 rng(400);
  for (const Shape& sh : shapes()) {
    SCOPED_TRACE(sh.name);
    const int64_t T = sh.T, k = sh.k, H = sh.H;
    const Ints row_map = naive_sort(random_ids(T, k, sh.E, rng, 5), sh.E).row_map;
    const Array a = random_array(dtype, T * H, rng);
    const Array rows = random_array(dtype, T * k * H, rng);
    Guarded<float> out(T * k, std::numeric_limits<float>::quiet_NaN());
    nodrop::cpu::gather_row_dots(a.data(), rows.data(), dtype, row_map.data(), T, k, H,
                                 out.data());
    EXPECT_TRUE(out.canaries_intact());
    const auto got = to_double(out.vec());
    // Products of two half-precision values are exact in float32: float32 tolerance applies.
    EXPECT_LE(rel_error(got, naive_row_dots(a, rows, row_map, T, k, H)), 1e-5);
    for (int64_t i = 0; i < T * k; ++i)
      if (row_map[i] < 0) EXPECT_EQ(got[i], 0.0) << "dropped slot " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, GatherRowDotsDtypes, testing::ValuesIn(kAllDtypes),
                         [](const testing::TestParamInfo<DType>& i) { return short_name(i.param); });

TEST(GatherRowDots, SkipsRowMapEntriesOutsideTheRowsWithoutReadingThem) {
  const int64_t T = 4, k = 2, H = 5;
  const Ints row_map = {3, -1, 0, 8, INT32_MIN, INT32_MAX, 1, 2};
  std::mt19937 rng(401);
  const Array a = random_array(DType::kFloat32, T * H, rng);
  const Array rows = random_array(DType::kFloat32, T * k * H, rng);
  const Fenced a_f(a), rows_f(rows), map_f(row_map);
  Guarded<float> out(T * k, std::numeric_limits<float>::quiet_NaN());
  nodrop::cpu::gather_row_dots(a_f.data(), rows_f.data(), DType::kFloat32, map_f.as<int32_t>(), T,
                               k, H, out.data());
  EXPECT_TRUE(out.canaries_intact());
  const auto got = to_double(out.vec());
  EXPECT_LE(rel_error(got, naive_row_dots(a, rows, row_map, T, k, H)), 1e-5);
  for (int i : {1, 3, 4, 5}) EXPECT_EQ(got[i], 0.0) << "entry " << i;
}

// ---- the ops together, and determinism ---------------------------------------------------------

TEST(Permute, SortScatterGatherGivesTheWeightedSumOverKeptSlots) {
  // unpermute(permute(x)) with weights w: out[t] = sum over kept slots of w[t, s] * x[t].
  const int64_t T = 29, k = 3, E = 7, H = 11;
  std::mt19937 rng(500);
  const Ints ids = random_ids(T, k, E, rng, 6);
  const Array x = random_array(DType::kFloat32, T * H, rng);
  const std::vector<float> w = random_floats(T * k, rng, 0.0, 1.0);
  Guarded<int32_t> row_map(T * k, 12345), sizes(E, 12345);
  ASSERT_TRUE(nodrop::cpu::sort_by_expert(ids.data(), T, k, E, false, row_map.data(),
                                          sizes.data()).ok());
  Array rows(DType::kFloat32, T * k * H), out(DType::kFloat32, T * H);
  nodrop::cpu::permute_rows(x.data(), DType::kFloat32, row_map.data(), nullptr, T, k, H,
                            rows.data());
  nodrop::cpu::unpermute(rows.data(), DType::kFloat32, row_map.data(), w.data(), T, k, H,
                         out.data());
  std::vector<double> want(T * H, 0.0);
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[i] >= 0 && ids[i] < E)
      for (int64_t h = 0; h < H; ++h) want[(i / k) * H + h] += w[i] * x.at((i / k) * H + h);
  EXPECT_LE(rel_error(out.values(), want), 1e-5);
}

TEST(Permute, TwoCallsGiveBitwiseIdenticalOutputs) {
  const int64_t T = 512, k = 4, E = 16, H = 96;
  std::mt19937 rng(501);
  const Ints ids = random_ids(T, k, E, rng, 9);
  const std::vector<float> w = random_floats(T * k, rng);
  for (DType dtype : kAllDtypes) {
    SCOPED_TRACE(short_name(dtype));
    const SortResult s1 = run_sort(ids, T, k, E, false), s2 = run_sort(ids, T, k, E, false);
    EXPECT_EQ(s1.row_map, s2.row_map);
    EXPECT_EQ(s1.sizes, s2.sizes);
    const Ints& row_map = s1.row_map;
    const Array x = random_array(dtype, T * H, rng);
    const Array rows = random_array(dtype, T * k * H, rng);
    Array sa(dtype, T * k * H), sb(dtype, T * k * H), ga(dtype, T * H), gb(dtype, T * H);
    nodrop::cpu::permute_rows(x.data(), dtype, row_map.data(), w.data(), T, k, H, sa.data());
    nodrop::cpu::permute_rows(x.data(), dtype, row_map.data(), w.data(), T, k, H, sb.data());
    EXPECT_EQ(sa.raw(), sb.raw());
    nodrop::cpu::unpermute(rows.data(), dtype, row_map.data(), w.data(), T, k, H, ga.data());
    nodrop::cpu::unpermute(rows.data(), dtype, row_map.data(), w.data(), T, k, H, gb.data());
    EXPECT_EQ(ga.raw(), gb.raw());
    Guarded<float> da(T * k, 0.f), db(T * k, 0.f);
    nodrop::cpu::gather_row_dots(x.data(), rows.data(), dtype, row_map.data(), T, k, H, da.data());
    nodrop::cpu::gather_row_dots(x.data(), rows.data(), dtype, row_map.data(), T, k, H, db.data());
    EXPECT_EQ(0, std::memcmp(da.data(), db.data(), T * k * sizeof(float)));
  }
}

TEST(Permute, ParallelRunnerGivesTheSerialResult) {
  // Scatter and gather arithmetic is fixed by the contract (w * x; a float32 sum in slot order),
  // so spreading rows over workers must not change a bit. The row dots match the reference.
  const int64_t T = 512, k = 4, E = 16, H = 96;
  std::mt19937 rng(502);
  const Ints row_map = naive_sort(random_ids(T, k, E, rng, 9), E).row_map;
  const std::vector<float> w = random_floats(T * k, rng);
  for (DType dtype : kAllDtypes) {
    SCOPED_TRACE(short_name(dtype));
    const Array x = random_array(dtype, T * H, rng);
    const Array rows = random_array(dtype, T * k * H, rng);
    ThreadRunner runner(4);
    Array serial_s(dtype, T * k * H), parallel_s(dtype, T * k * H);
    nodrop::cpu::permute_rows(x.data(), dtype, row_map.data(), w.data(), T, k, H, serial_s.data());
    nodrop::cpu::permute_rows(x.data(), dtype, row_map.data(), w.data(), T, k, H,
                              parallel_s.data(), &runner);
    EXPECT_EQ(serial_s.raw(), parallel_s.raw());
    Array serial_g(dtype, T * H), parallel_g(dtype, T * H);
    nodrop::cpu::unpermute(rows.data(), dtype, row_map.data(), w.data(), T, k, H,
                           serial_g.data());
    nodrop::cpu::unpermute(rows.data(), dtype, row_map.data(), w.data(), T, k, H,
                           parallel_g.data(), &runner);
    EXPECT_EQ(serial_g.raw(), parallel_g.raw());
    Guarded<float> dots(T * k, std::numeric_limits<float>::quiet_NaN());
    nodrop::cpu::gather_row_dots(x.data(), rows.data(), dtype, row_map.data(), T, k, H,
                                 dots.data(), &runner);
    EXPECT_TRUE(parallel_s.canaries_intact() && parallel_g.canaries_intact() &&
                dots.canaries_intact());
    EXPECT_LE(rel_error(to_double(dots.vec()), naive_row_dots(x, rows, row_map, T, k, H)), 1e-5);
    EXPECT_GE(runner.calls(), 3) << "shape too small to exercise the runner";
  }
}

}  // namespace
