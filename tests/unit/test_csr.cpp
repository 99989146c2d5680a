#include <gtest/gtest.h>

#include "dense_reference.h"
#include "kvcal/graph/csr.h"

namespace kvcal {
namespace {

CsrMask small_valid() {
  // 3x4, rows {0,2}, {1,3}, {0,3}
  return CsrMask{3, 4, {0, 2, 4, 6}, {0, 2, 1, 3, 0, 3}};
}

bool mentions(const StructureReport& r, const std::string& word) {
  for (const auto& p : r.problems) {
    if (p.find(word) != std::string::npos) return true;
  }
  return false;
}

TEST(CheckStructure, ValidMaskDegrees) {
  const auto r = check_structure(small_valid());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.row_degree_min, 2);
  EXPECT_EQ(r.row_degree_max, 2);
  EXPECT_EQ(r.col_degree_min, 1);
  EXPECT_EQ(r.col_degree_max, 2);
  EXPECT_FALSE(r.biregular);
  EXPECT_TRUE(r.near_biregular);  // column degrees 2, 1, 1, 2 differ by one
}

TEST(CheckStructure, DetectsEachDefect) {
  auto m = small_valid();
  m.indices[1] = 0;  // row 0 = {0, 0}: a repeated edge
  EXPECT_TRUE(mentions(check_structure(m), "repeated"));

  m = small_valid();
  std::swap(m.indices[2], m.indices[3]);  // row 1 = {3, 1}
  EXPECT_TRUE(mentions(check_structure(m), "ascending"));

  m = small_valid();
  m.indices[5] = 4;  // out of range
  EXPECT_TRUE(mentions(check_structure(m), "out of range"));

  m = small_valid();
  m.indices[5] = -1;
  EXPECT_TRUE(mentions(check_structure(m), "out of range"));

  m = small_valid();
  m.indptr = {0, 2, 4};  // wrong length
  EXPECT_TRUE(mentions(check_structure(m), "indptr has"));

  m = small_valid();
  m.indptr = {1, 2, 4, 6};
  EXPECT_TRUE(mentions(check_structure(m), "indptr[0]"));

  m = small_valid();
  m.indptr = {0, 4, 2, 6};
  EXPECT_TRUE(mentions(check_structure(m), "decreases"));

  m = small_valid();
  m.indptr.back() = 5;
  EXPECT_FALSE(check_structure(m).ok());

  m = small_valid();
  m.rows = 0;
  EXPECT_FALSE(check_structure(m).ok());
}

TEST(CheckStructure, ComponentsOfDisjointBlocks) {
  Eigen::MatrixXd b = Eigen::MatrixXd::Zero(8, 8);
  b.topLeftCorner(4, 4).setOnes();
  b.bottomRightCorner(4, 4).setOnes();
  const auto r = check_structure(test::from_dense(b));
  EXPECT_TRUE(r.ok());
  EXPECT_TRUE(r.biregular);
  EXPECT_EQ(r.components, 2);
  b(0, 7) = 1;
  b(0, 3) = 0;
  EXPECT_EQ(check_structure(test::from_dense(b)).components, 1);
}

TEST(Transpose, MatchesDenseTranspose) {
  const auto m = small_valid();
  const auto t = transpose(m);
  EXPECT_TRUE(check_structure(t).ok());
  EXPECT_EQ(test::to_dense(t), test::to_dense(m).transpose());
  EXPECT_EQ(transpose(t), m);
}

}  // namespace
}  // namespace kvcal
