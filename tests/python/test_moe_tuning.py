"""The ctypes mirrors of the MoE kernels' parameter structs (python/p2pcomm/moe.py)
against the layout tables and static_asserts in native/kernels/moe_common.cuh; the
kernel names moe.py launches against moe_*.cu's instantiations; and the A/B
knobs. (native/kernels' Go test compiles every kernel for sm_80 and sm_90 and
checks that none spills.)"""

import ctypes
import pathlib
import re

import pytest

from p2pcomm import moe

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "native" / "kernels"
MOE_CU = KERNELS / "moe_common.cuh"
MOE_FILES = [KERNELS / "moe_dispatch.cu", KERNELS / "moe_combine.cu"]
STRUCTS = {"MoeDispatchParams": moe._DispatchParams, "MoeExpandParams": moe._ExpandParams,
           "MoeCombineParams": moe._CombineParams, "MoePostParams": moe._PostParams, "MoeSync": moe._Sync}


def layout_tables(src: str) -> dict:
    """{struct: ({field: (offset, size)}, total)} from the comment tables that
    precede each struct in moe_common.cuh."""
    tables = {}
    for m in re.finditer(r"((?://[^\n]*\n)+)struct (\w+) \{", src):
        rows = re.findall(r"^//\s+(\d+)\s+(\d+)\s+(\w+)", m.group(1), re.M)
        total = re.search(r"^//\s+total\s+(\d+)", m.group(1), re.M)
        if rows and total:
            tables[m.group(2)] = ({f: (int(o), int(s)) for o, s, f in rows}, int(total.group(1)))
    return tables


def test_tables_cover_every_struct():
    assert set(layout_tables(MOE_CU.read_text())) == set(STRUCTS)


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_ctypes_matches_table_and_static_assert(name):
    src = MOE_CU.read_text()
    fields, total = layout_tables(src)[name]
    struct = STRUCTS[name]
    asserted = re.search(rf"static_assert\(sizeof\({name}\) == (\d+)", src)
    assert asserted, f"no size static_assert for {name}"
    assert int(asserted.group(1)) == total == ctypes.sizeof(struct), (asserted.group(1), total,
                                                                      ctypes.sizeof(struct))
    got = {f: (getattr(struct, f).offset, getattr(struct, f).size) for f, _ in struct._fields_}
    assert got == fields, f"{name}: ctypes {got} != moe_common.cuh {fields}"


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_struct_fields_in_table_order(name):
    """The C struct declares the fields in the table's order (so offsets follow)."""
    src = MOE_CU.read_text()
    body = re.search(rf"struct {name} \{{(.*?)\}};", src, re.S).group(1)
    declared = re.findall(r"(\w+)(?:\[kMaxRanks\])?;", body)
    assert declared == [f for f, _ in STRUCTS[name]._fields_]


def test_sync_constants_match():
    """The in-kernel barriers' constants moe.py allocates and passes by."""
    src = MOE_CU.read_text()
    const = lambda name: int(re.search(rf"constexpr int {name} = (\d+);", src).group(1))  # noqa: E731
    names = ("kSyncStart", "kSyncArrive", "kSyncWait", "kSyncArriveFirst", "kSyncStageGo", "kSyncStaged",
             "kSyncPostStaged")
    bits = [moe._SYNC_START, moe._SYNC_ARRIVE, moe._SYNC_WAIT, moe._SYNC_ARRIVE_FIRST, moe._SYNC_STAGE_GO,
            moe._SYNC_STAGED, moe._SYNC_POST_STAGED]
    assert [const(n) for n in names] == bits
    assert moe._SYNC_MODES == 2 * max(bits) <= 1 << moe._SYNC_GRID_SHIFT  # every combination, under the grid
    assert const("kMoeKinds") == 2 and const("kMoeSyncBlocks") == moe._MAX_SYNC_BLOCKS
    state = int(re.search(r"static_assert\(sizeof\(MoeSyncState\) == (\d+)", src).group(1))
    assert const("kMoeKinds") * state == moe._SYNC_STATE_BYTES
    assert re.search(r"constexpr int kMoeMidFlagBase = kMoeKinds \* 2 \* kMaxRanks;", src)
    assert re.search(r"constexpr int kMoeFlagWords = kMoeMidFlagBase \+ kMoeKinds \* kMaxRanks \* kMoeSyncBlocks;", src)
    assert moe._SYNC_FLAG_WORDS == 2 * 2 * moe._MAX_RANKS + 2 * moe._MAX_RANKS * moe._MAX_SYNC_BLOCKS
    assert const("kSyncGridShift") == moe._SYNC_GRID_SHIFT and moe._MAX_SYNC_BLOCKS << moe._SYNC_GRID_SHIFT < 2**31


def instantiations() -> list:
    return [e for f in MOE_FILES for e in re.findall(r"^// p2pcomm:instantiate (.+)$", f.read_text(), re.M)]


def test_every_kernel_instantiated_for_each_type():
    exprs = instantiations()
    assert set(exprs) == moe.kernel_expressions()
    assert len(exprs) == len(set(exprs))
    # Dispatch kernels per dtype; combine kernels per dtype and transit (float32 or the dtype itself).
    assert {e for e in exprs if e.startswith("moe_combine_send")} == {
        "moe_combine_send<bf16, float>", "moe_combine_send<bf16, bf16>", "moe_combine_send<half16, float>",
        "moe_combine_send<half16, half16>", "moe_combine_send<float, float>"}


def test_self_local_topk_bound():
    """moe.py sends a world of 2 down the self-local combine only for topk up
    to moe_combine.cu's kCombWide (twice kCombGroup), the layouts
    moe_combine_reduce_self loads a token's own rows in."""
    src = MOE_FILES[1].read_text()
    group = int(re.search(r"constexpr int kCombGroup = (\d+);", src).group(1))
    assert re.search(r"constexpr int kCombWide = 2 \* kCombGroup <= 32 \? 2 \* kCombGroup : 32;", src)
    assert moe._SELF_LOCAL_MAX_TOPK == min(2 * group, 32)


def test_count_pairs_knob(monkeypatch):
    """P2PCOMM_MOE_COUNT_PAIRS (A/B runs): unset -> the default, an integer
    -> itself, anything else -> a warning and the default, never silently."""
    monkeypatch.delenv("P2PCOMM_MOE_COUNT_PAIRS", raising=False)
    assert moe._count_kernel_min_pairs() == moe._COUNT_KERNEL_MIN_PAIRS
    for v, want in (("0", 0), (" 1000000000 ", 1000000000)):
        monkeypatch.setenv("P2PCOMM_MOE_COUNT_PAIRS", v)
        assert moe._count_kernel_min_pairs() == want
    for v in ("1e9", "-1", "8k"):
        monkeypatch.setenv("P2PCOMM_MOE_COUNT_PAIRS", v)
        with pytest.warns(UserWarning, match="P2PCOMM_MOE_COUNT_PAIRS"):
            assert moe._count_kernel_min_pairs() == moe._COUNT_KERNEL_MIN_PAIRS


def test_self_local_knob(monkeypatch):
    """P2PCOMM_MOE_SELF_LOCAL (A/B runs): unset -> "auto", 0 -> "never", 1 ->
    "always", anything else -> a warning and "auto", never silently."""
    monkeypatch.delenv("P2PCOMM_MOE_SELF_LOCAL", raising=False)
    assert moe._self_local_mode() == "auto"
    for v, want in (("0", "never"), (" 1 ", "always"), ("", "auto")):
        monkeypatch.setenv("P2PCOMM_MOE_SELF_LOCAL", v)
        assert moe._self_local_mode() == want
    for v in ("yes", "2", "off"):
        monkeypatch.setenv("P2PCOMM_MOE_SELF_LOCAL", v)
        with pytest.warns(UserWarning, match="P2PCOMM_MOE_SELF_LOCAL"):
            assert moe._self_local_mode() == "auto"
