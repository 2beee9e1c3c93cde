"""The ctypes mirrors of moe.cu's parameter structs (python/p2pcomm/moe.py)
against the layout tables and static_asserts in native/kernels/moe.cu."""

import ctypes
import pathlib
import re

import pytest

from p2pcomm import moe

MOE_CU = pathlib.Path(__file__).resolve().parents[2] / "native" / "kernels" / "moe.cu"
STRUCTS = {"MoeDispatchParams": moe._DispatchParams, "MoeExpandParams": moe._ExpandParams,
           "MoeCombineParams": moe._CombineParams}


def layout_tables(src: str) -> dict:
    """{struct: ({field: (offset, size)}, total)} from the comment tables that
    precede each struct in moe.cu."""
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
    assert got == fields, f"{name}: ctypes {got} != moe.cu {fields}"


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_struct_fields_in_table_order(name):
    """The C struct declares the fields in the table's order (so offsets follow)."""
    src = MOE_CU.read_text()
    body = re.search(rf"struct {name} \{{(.*?)\}};", src, re.S).group(1)
    declared = re.findall(r"(\w+)(?:\[kMaxRanks\])?;", body)
    assert declared == [f for f, _ in STRUCTS[name]._fields_]


def test_every_kernel_instantiated_for_each_type():
    exprs = re.findall(r"^// p2pcomm:instantiate (.+)$", MOE_CU.read_text(), re.M)
    kernels = ["moe_dispatch_send", "moe_dispatch_expand", "moe_combine_send", "moe_combine_reduce"]
    want = {f"{k}<{t}>" for k in kernels for t in moe._KERNEL_TYPES.values()}
    assert set(exprs) == want
