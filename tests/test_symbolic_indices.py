"""simplify_symbolic_indices: indices that chains of reshapes over a symbolic size leave
(``(j * seq * seq + i * seq + k) // seq // seq % 4``) become the iterators they select; what
is not exactly a selection of whole digits stays as it is."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from tvm_fusion.tir_schedules.symbolic_indices import simplify_symbolic_indices


def test_a_head_split_and_merge_reads_the_iterators():
    @T.prim_func(s_tir=True)
    def before(a: T.handle, c: T.handle):
        seq = T.int64()
        A = T.match_buffer(a, (4, seq, seq), "float32")
        C = T.match_buffer(c, (seq, 4, seq), "float32")
        for i, j, k in T.grid(seq, T.int64(4), seq):
            with T.sblock("C"):
                vi, vj, vk = T.axis.remap("SSS", [i, j, k])
                C[vi, vj, vk] = A[(vj * seq * seq + vi * seq + vk) // seq // seq % T.int64(4),
                                  (vj * seq * seq + vi * seq + vk) // seq % seq,
                                  (vj * seq * seq + vi * seq + vk) % seq]

    @T.prim_func(s_tir=True)
    def expected(a: T.handle, c: T.handle):
        seq = T.int64()
        A = T.match_buffer(a, (4, seq, seq), "float32")
        C = T.match_buffer(c, (seq, 4, seq), "float32")
        for i, j, k in T.grid(seq, T.int64(4), seq):
            with T.sblock("C"):
                vi, vj, vk = T.axis.remap("SSS", [i, j, k])
                C[vi, vj, vk] = A[vj, vi, vk]

    after = simplify_symbolic_indices(before)
    tvm.ir.assert_structural_equal(after.with_attr("global_symbol", "expected"), expected)


def test_an_index_that_is_no_whole_digit_stays():
    """``(i + 1) // seq`` is 1 in the last row: it selects no iterator and is kept."""

    @T.prim_func(s_tir=True)
    def before(a: T.handle, c: T.handle):
        seq = T.int64()
        A = T.match_buffer(a, (2, seq), "float32")
        C = T.match_buffer(c, (seq,), "float32")
        for i in T.serial(seq):
            with T.sblock("C"):
                vi = T.axis.spatial(seq, i)
                C[vi] = A[(vi + T.int64(1)) // seq, (vi + T.int64(1)) % seq]

    after = simplify_symbolic_indices(before)
    tvm.ir.assert_structural_equal(after.body, before.body, map_free_vars=True)


def test_static_functions_are_returned_as_they_are():
    @T.prim_func(s_tir=True)
    def static(A: T.Buffer((4, 8), "float32"), C: T.Buffer((8, 4), "float32")):
        for i, j in T.grid(8, 4):
            with T.sblock("C"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = A[vj, vi]

    assert simplify_symbolic_indices(static).same_as(static)


def test_a_bmm_operand_through_torch_export_reshapes_reads_the_iterators():
    """torch.export's ``bmm`` of the probabilities and V (``broadcast_to`` + ``reshape`` over
    ``seq``, then the head merge) leaves a split of extent 1 (``(j * 32 + l) // 128``, always
    0) beside the reduction iterator, and constant remainders the iterators' ranges make
    exact: the operand must read ``B[k, j * 32 + l]``, or the tile rules see no GEMM."""

    @T.prim_func(s_tir=True)
    def before(a: T.handle, b: T.handle, c: T.handle):
        seq = T.int64()
        A = T.match_buffer(a, (4, seq, seq), "float32")
        B = T.match_buffer(b, (seq, 128), "float32")
        C = T.match_buffer(c, (4, seq, 32), "float32")
        for j, i, l, k in T.grid(T.int64(4), seq, T.int64(32), seq):
            with T.sblock("C"):
                vj, vi, vl, vk = T.axis.remap("SSSR", [j, i, l, k])
                with T.init():
                    C[vj, vi, vl] = T.float32(0.0)
                C[vj, vi, vl] = C[vj, vi, vl] + A[vj, vi, vk] * B[
                    ((vj * T.int64(32) + vl % T.int64(32)) // T.int64(128) + vk) % seq,
                    (vj * T.int64(32) + vl % T.int64(32)) % T.int64(128) % T.int64(128)]

    @T.prim_func(s_tir=True)
    def expected(a: T.handle, b: T.handle, c: T.handle):
        seq = T.int64()
        A = T.match_buffer(a, (4, seq, seq), "float32")
        B = T.match_buffer(b, (seq, 128), "float32")
        C = T.match_buffer(c, (4, seq, 32), "float32")
        for j, i, l, k in T.grid(T.int64(4), seq, T.int64(32), seq):
            with T.sblock("C"):
                vj, vi, vl, vk = T.axis.remap("SSSR", [j, i, l, k])
                with T.init():
                    C[vj, vi, vl] = T.float32(0.0)
                C[vj, vi, vl] = C[vj, vi, vl] + A[vj, vi, vk] * B[vk, vj * T.int64(32) + vl]

    after = simplify_symbolic_indices(before)
    tvm.ir.assert_structural_equal(after.with_attr("global_symbol", "expected"), expected)
