"""Tests for aioloader._data.collate: torch-compatible default_collate and default_convert."""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate as _torch_default_collate
from torch.utils.data import default_convert as _torch_default_convert

from aioloader._data.collate import default_collate
from aioloader._data.convert import default_convert

# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------

# The reference implementations (torch's are untyped).
torch_default_collate: Callable[[Any], Any] = _torch_default_collate
torch_default_convert: Callable[[Any], Any] = _torch_default_convert


def assert_same(ours: Any, ref: Any, path: str = "batch") -> None:
    """Assert that ``ours`` has exactly the structure, types and values of ``ref``."""
    assert type(ours) is type(ref), f"{path}: {type(ours)} != {type(ref)}"
    if isinstance(ref, torch.Tensor):
        assert ours.dtype == ref.dtype, f"{path}: {ours.dtype} != {ref.dtype}"
        assert ours.shape == ref.shape, f"{path}: {ours.shape} != {ref.shape}"
        assert ours.device == ref.device, f"{path}: {ours.device} != {ref.device}"
        assert torch.equal(ours, ref), f"{path}: {ours} != {ref}"
    elif isinstance(ref, np.ndarray):
        assert ours.dtype == ref.dtype
        np.testing.assert_array_equal(ours, ref)
    elif isinstance(ref, str | bytes):
        assert ours == ref, f"{path}: {ours!r} != {ref!r}"
    elif isinstance(ref, Mapping):
        assert list(ours.keys()) == list(ref.keys()), f"{path}: keys differ"
        if isinstance(ref, collections.defaultdict):
            assert ours.default_factory is ref.default_factory
        for key in ref:
            assert_same(ours[key], ref[key], f"{path}[{key!r}]")
    elif isinstance(ref, Sequence):
        assert len(ours) == len(ref), f"{path}: length {len(ours)} != {len(ref)}"
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == ref, f"{path}: {ours!r} != {ref!r}"


def assert_matches_torch(batch: Sequence[Any]) -> None:
    assert_same(default_collate(batch), torch_default_collate(batch))


class Point(NamedTuple):
    x: Any
    y: Any


class Triple(NamedTuple):
    a: Any
    b: Any
    c: Any


class FrozenMapping(Mapping[str, Any]):
    """An immutable mapping that can be built from a dict."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class UnbuildableMapping(FrozenMapping):
    """An immutable mapping whose constructor does not take a dict."""

    def __init__(self, data: Mapping[str, Any], extra: int) -> None:
        super().__init__(data)
        self.extra = extra


class Pair(Sequence[Any]):
    """An immutable sequence that can be built from a list."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = tuple(items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pair) and self._items == other._items

    __hash__ = None  # type: ignore[assignment]


# ------------------------------------------------------------------------------------------
# default_collate against torch: one type at a time, then nested
# ------------------------------------------------------------------------------------------

CASES: dict[str, list[Any]] = {
    "tensor-float": [torch.randn(3, 4), torch.randn(3, 4)],
    "tensor-int": [torch.arange(5), torch.arange(5) * 2],
    "tensor-0d": [torch.tensor(1.5), torch.tensor(2.5)],
    "tensor-bool": [torch.tensor([True, False]), torch.tensor([False, False])],
    "tensor-half": [torch.ones(2, dtype=torch.float16), torch.zeros(2, dtype=torch.float16)],
    "tensor-empty": [torch.empty(0, 3), torch.empty(0, 3)],
    "tensor-mixed-dtypes": [torch.tensor([1, 2]), torch.tensor([1.5, 2.5])],
    "tensor-noncontiguous": [torch.randn(4, 3).t(), torch.randn(4, 3).t()],
    "ndarray-float32": [np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)],
    "ndarray-float64": [np.linspace(0, 1, 4), np.linspace(1, 2, 4)],
    "ndarray-int32": [np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32)],
    "ndarray-uint8": [np.full((2, 2), 255, np.uint8), np.zeros((2, 2), np.uint8)],
    "ndarray-bool": [np.array([True, False]), np.array([False, True])],
    "ndarray-0d": [np.array(3), np.array(4)],
    "np-scalar-float32": [np.float32(1.5), np.float32(2.5)],
    "np-scalar-float64": [np.float64(1.5), np.float64(2.5)],
    "np-scalar-int64": [np.int64(7), np.int64(-7)],
    "np-scalar-int16": [np.int16(7), np.int16(-7)],
    "np-scalar-bool": [np.bool_(True), np.bool_(False)],
    "np-str-scalar": [np.str_("a"), np.str_("b")],
    "int": [1, 2, 3],
    "int-large": [2**62, -(2**62)],
    "float": [1.5, -2.0],
    "bool": [True, False, True],
    "bool-then-int": [True, 2],
    "int-then-float": [1, 2.5],
    "float-then-int": [2.5, 1],
    "str": ["a", "bc"],
    "bytes": [b"a", b"bc"],
    "dict": [{"a": 1, "b": 2.0}, {"a": 3, "b": 4.0}],
    "ordered-dict": [collections.OrderedDict(b=1, a=2), collections.OrderedDict(b=3, a=4)],
    "defaultdict": [collections.defaultdict(list, x=1), collections.defaultdict(list, x=2)],
    "mappingproxy": [types.MappingProxyType({"x": 1}), types.MappingProxyType({"x": 2})],
    "frozen-mapping": [FrozenMapping({"x": 1}), FrozenMapping({"x": 2})],
    "unbuildable-mapping": [UnbuildableMapping({"x": 1}, 0), UnbuildableMapping({"x": 2}, 0)],
    "namedtuple": [Point(1, 2.0), Point(3, 4.0)],
    "tuple": [(1, 2.0), (3, 4.0)],
    "list": [[1, 2], [3, 4]],
    "list-empty": [[], []],
    "list-of-strings": [["a", "b"], ["c", "d"]],
    "range": [range(3), range(3)],
    "custom-sequence": [Pair([1, 2]), Pair([3, 4])],
    "list-and-tuple": [[1, 2], (3, 4)],
    "bytearray": [bytearray(b"ab"), bytearray(b"cd")],
    "dict-nested": [
        {"image": torch.ones(3, 2), "label": 1, "name": "a", "meta": {"w": 0.5, "ok": True}},
        {"image": torch.zeros(3, 2), "label": 0, "name": "b", "meta": {"w": 1.5, "ok": False}},
    ],
    "list-of-namedtuples": [
        [Point(torch.ones(2), "p"), Point(torch.zeros(2), "q")],
        [Point(torch.zeros(2), "r"), Point(torch.ones(2), "s")],
    ],
    "tuple-nested": [
        (np.ones(2, np.float32), ("a", 1), [1.0, 2.0]),
        (np.zeros(2, np.float32), ("b", 2), [3.0, 4.0]),
    ],
    "namedtuple-of-dicts": [
        Triple({"k": 1}, [np.int64(1)], "x"),
        Triple({"k": 2}, [np.int64(2)], "y"),
    ],
    "strings-in-tuple": [("a", 1), ("b", 2)],
    "strings-in-dict": [{"s": "a"}, {"s": "b"}],
}


@pytest.mark.parametrize("batch", list(CASES.values()), ids=list(CASES))
def test_default_collate_matches_torch(batch: list[Any]) -> None:
    assert_matches_torch(batch)


def test_bool_batch_gives_bool_tensor() -> None:
    result = default_collate([True, False])
    assert result.dtype == torch.bool
    assert result.tolist() == [True, False]


def test_strings_at_top_level_come_back_unchanged() -> None:
    batch = ["a", "b"]
    assert default_collate(batch) == ["a", "b"]
    assert torch_default_collate(batch) is batch  # torch returns the very same list


def test_defaultdict_keeps_its_factory() -> None:
    result = default_collate([collections.defaultdict(list, x=1)] * 2)
    assert isinstance(result, collections.defaultdict)
    assert result.default_factory is list
    assert result["missing"] == []


def test_tensors_requiring_grad_match_torch() -> None:
    a = torch.ones(2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    ours = default_collate([a, b])
    assert ours.requires_grad
    assert_same(ours.detach(), torch_default_collate([a, b]).detach())


def test_tensor_subclass_matches_torch() -> None:
    class Tagged(torch.Tensor):
        pass

    batch = [torch.ones(2).as_subclass(Tagged), torch.zeros(2).as_subclass(Tagged)]
    assert_matches_torch(batch)


def test_numpy_string_arrays_raise_type_error_like_torch() -> None:
    batch = [{"x": np.array(["a", "b"])}, {"x": np.array(["c", "d"])}]
    with pytest.raises(TypeError):
        torch_default_collate(batch)
    with pytest.raises(TypeError, match=r"sample\['x'\].*<U1"):
        default_collate(batch)


def test_numpy_object_arrays_raise_type_error() -> None:
    batch = [np.array([object()]), np.array([object()])]
    with pytest.raises(TypeError, match="object"):
        default_collate(batch)


def test_accepts_any_iterable_batch() -> None:
    assert_same(default_collate(cast(Any, iter([1, 2]))), torch.tensor([1, 2]))
    assert_same(default_collate((1.0, 2.0)), torch_default_collate((1.0, 2.0)))


# ------------------------------------------------------------------------------------------
# default_collate against torch: hypothesis property
# ------------------------------------------------------------------------------------------

TORCH_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]
NP_DTYPES = [np.float32, np.float64, np.int64, np.int16, np.uint8, np.bool_]

# A schema describes one position of a sample; every sample of a batch follows it.
Schema = tuple[Any, ...]
leaf_schemas: st.SearchStrategy[Schema] = st.one_of(
    st.tuples(
        st.just("tensor"),
        st.lists(st.integers(0, 3), max_size=3).map(tuple),
        st.sampled_from(TORCH_DTYPES),
    ),
    st.tuples(
        st.just("ndarray"),
        st.lists(st.integers(0, 3), max_size=3).map(tuple),
        st.sampled_from(NP_DTYPES),
    ),
    st.tuples(st.just("npscalar"), st.sampled_from(NP_DTYPES)),
    st.sampled_from([("int",), ("float",), ("bool",), ("str",), ("bytes",)]),
)

schemas: st.SearchStrategy[Schema] = st.recursive(
    leaf_schemas,
    lambda children: st.one_of(
        st.tuples(
            st.just("dict"),
            st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), children, max_size=3),
        ),
        st.tuples(st.just("tuple"), st.lists(children, max_size=3).map(tuple)),
        st.tuples(st.just("list"), st.lists(children, max_size=3).map(tuple)),
        st.tuples(st.just("point"), children, children),
    ),
    max_leaves=8,
)


def _random_tensor(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 100, shape, generator=gen, dtype=dtype)


def _random_array(seed: int, shape: tuple[int, ...], dtype: type[Any]) -> Any:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 100, size=shape).astype(dtype)


@st.composite
def sample_from(draw: st.DrawFn, schema: Schema) -> Any:
    kind = schema[0]
    seeds = st.integers(0, 2**32 - 1)
    if kind == "tensor":
        return _random_tensor(draw(seeds), schema[1], schema[2])
    if kind == "ndarray":
        return _random_array(draw(seeds), schema[1], schema[2])
    if kind == "npscalar":
        return schema[1](draw(st.integers(0, 100)))
    if kind == "int":
        return draw(st.integers(-(2**63), 2**63 - 1))
    if kind == "float":
        return draw(st.floats(allow_nan=False))
    if kind == "bool":
        return draw(st.booleans())
    if kind == "str":
        return draw(st.text(max_size=5))
    if kind == "bytes":
        return draw(st.binary(max_size=5))
    if kind == "dict":
        return {key: draw(sample_from(child)) for key, child in schema[1].items()}
    if kind == "tuple":
        return tuple(draw(sample_from(child)) for child in schema[1])
    if kind == "list":
        return [draw(sample_from(child)) for child in schema[1]]
    assert kind == "point"
    return Point(draw(sample_from(schema[1])), draw(sample_from(schema[2])))


@st.composite
def batches(draw: st.DrawFn) -> list[Any]:
    schema = draw(schemas)
    size = draw(st.integers(1, 4))
    return [draw(sample_from(schema)) for _ in range(size)]


@settings(max_examples=100, deadline=None)
@given(batches())
def test_default_collate_matches_torch_property(batch: list[Any]) -> None:
    assert_matches_torch(batch)


@settings(max_examples=50, deadline=None)
@given(batches())
def test_default_convert_matches_torch_property(batch: list[Any]) -> None:
    for sample in batch:
        assert_same(default_convert(sample), torch_default_convert(sample))


# ------------------------------------------------------------------------------------------
# default_collate errors
# ------------------------------------------------------------------------------------------


def test_empty_batch_raises_value_error() -> None:
    with pytest.raises(ValueError, match="cannot collate an empty batch"):
        default_collate([])


def test_unequal_lengths_raise_runtime_error_like_torch() -> None:
    batch = [{"ids": [1, 2]}, {"ids": [3]}]
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal size"):
        torch_default_collate(batch)
    with pytest.raises(
        RuntimeError, match=r"sample\['ids'\]: each element in list of batch should be of equal"
    ):
        default_collate(batch)


def test_unsupported_type_names_type_and_path() -> None:
    batch = [{"image": [1, object()]}, {"image": [2, object()]}]
    with pytest.raises(
        TypeError, match=r"^sample\['image'\]\[1\]: cannot collate <class 'object'>"
    ):
        default_collate(batch)


@pytest.mark.parametrize("value", [None, 1j, {1, 2}, object()], ids=["None", "1j", "set", "object"])
def test_unsupported_types_raise_type_error_like_torch(value: Any) -> None:
    with pytest.raises(TypeError):
        torch_default_collate([value, value])
    with pytest.raises(TypeError, match=r"^sample: cannot collate"):
        default_collate([value, value])


def test_unsupported_type_in_namedtuple_names_the_field() -> None:
    with pytest.raises(TypeError, match=r"^sample\[0\]\.y: cannot collate <class 'NoneType'>"):
        default_collate([(Point(1, None),), (Point(2, None),)])


def test_mismatched_tensor_shapes_name_path_and_shapes() -> None:
    batch = [
        {"image": torch.zeros(3, 4)},
        {"image": torch.zeros(3, 4)},
        {"image": torch.zeros(3, 5)},
    ]
    with pytest.raises(RuntimeError) as info:
        default_collate(batch)
    message = str(info.value)
    assert "sample['image']" in message
    assert "(3, 4)" in message
    assert "(3, 5)" in message


def test_mismatched_numpy_shapes_name_path_and_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"sample\[1\].*\(2,\).*\(3,\)"):
        default_collate([(0, np.zeros(2)), (1, np.zeros(3))])


def test_tensor_mixed_with_non_tensor_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"sample\['x'\].*sample 1.*int"):
        default_collate([{"x": torch.zeros(2)}, {"x": 3}])


def test_missing_key_raises_key_error_naming_key() -> None:
    with pytest.raises(KeyError, match=r"sample 1 has no key 'b'"):
        default_collate([{"a": 1, "b": 2}, {"a": 3}])


def test_a_sample_that_is_no_mapping_among_mappings_is_named() -> None:
    """Checked per batch, not per sample, since a list indexed by the key could pass."""
    with pytest.raises(TypeError, match=r"expected a mapping in every sample.*sample 2 has"):
        default_collate([{0: 1}, {0: 2}, [3]])


def test_mappings_of_different_types_collate_by_the_first() -> None:
    batch = [collections.OrderedDict(a=1), {"a": 2}, collections.OrderedDict(a=3)]
    out = default_collate(batch)
    assert type(out) is collections.OrderedDict and out["a"].tolist() == [1, 2, 3]


def test_a_sample_without_a_length_among_sequences_is_named() -> None:
    with pytest.raises(TypeError) as info:
        default_collate([(1, 2), (3, 4), 5])
    assert any("sample 2" in note for note in info.value.__notes__)
    with pytest.raises(RuntimeError, match=r"sample 0 has length 2, sample 1 has length 3"):
        default_collate([(1, 2), (3, 4, 5), (6, 7)])


def test_an_unequal_length_is_named_before_a_later_sample_whose_len_fails() -> None:
    """Found by review: the lengths are read in one pass; a later sample whose ``__len__``
    raises must not hide the earlier mismatch the sample-by-sample check names."""

    class Broken(list[int]):
        def __len__(self) -> int:
            raise ValueError("no length")

    with pytest.raises(RuntimeError, match="sample 1 has length 1"):
        default_collate([[1, 2], [1], Broken([3, 4])])


def test_torch_errors_keep_type_and_gain_a_path_note() -> None:
    with pytest.raises(TypeError) as info:
        default_collate([{"n": 1}, {"n": "two"}])
    assert any("sample['n']" in note for note in info.value.__notes__)


@pytest.mark.parametrize("batch", ["ab", b"ab", {"a": 1}, 3], ids=repr)
def test_non_sequence_batch_raises_type_error(batch: Any) -> None:
    with pytest.raises(TypeError, match="batch must be a sequence of samples"):
        default_collate(batch)


# ------------------------------------------------------------------------------------------
# dataclass extension
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int
    name: str
    extra: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    ids: np.ndarray[Any, Any]
    weight: float


@dataclasses.dataclass
class Validated:
    label: int
    doubled: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.label, int):
            raise TypeError("label must be an int")
        self.doubled = 2 * self.label


def test_dataclass_is_collated_field_wise() -> None:
    batch = [
        Sample(torch.ones(2, 2), 1, "a", {"w": 0.5}),
        Sample(torch.zeros(2, 2), 0, "b", {"w": 1.5}),
    ]
    result = default_collate(batch)
    assert type(result) is Sample
    assert_same(result.image, torch.stack([torch.ones(2, 2), torch.zeros(2, 2)]))
    assert_same(result.label, torch.tensor([1, 0]))
    assert cast(Any, result.name) == ["a", "b"]
    assert_same(result.extra, {"w": torch.tensor([0.5, 1.5], dtype=torch.float64)})


def test_frozen_dataclass_is_collated_field_wise() -> None:
    batch = [FrozenSample(np.arange(3), 0.5), FrozenSample(np.arange(3) + 1, 1.5)]
    result = default_collate(batch)
    assert type(result) is FrozenSample
    assert_same(result.ids, torch.tensor([[0, 1, 2], [1, 2, 3]]))
    assert_same(result.weight, torch.tensor([0.5, 1.5], dtype=torch.float64))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.weight = 0.0  # type: ignore[misc]


def test_dataclass_post_init_is_not_rerun_on_the_batch() -> None:
    result = default_collate([Validated(1), Validated(2)])
    assert_same(result.label, torch.tensor([1, 2]))
    assert_same(result.doubled, torch.tensor([2, 4]))


def test_dataclass_nested_in_containers() -> None:
    batch = [{"s": [FrozenSample(np.zeros(1), 1.0)]}, {"s": [FrozenSample(np.ones(1), 2.0)]}]
    result = default_collate(batch)
    assert type(result["s"][0]) is FrozenSample


def test_dataclass_mixed_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match=r"sample\['s'\].*sample 1"):
        default_collate([{"s": Validated(1)}, {"s": FrozenSample(np.zeros(1), 1.0)}])


def test_dataclass_unsupported_field_names_the_path() -> None:
    with pytest.raises(TypeError, match=r"^sample\.extra\['w'\]: cannot collate"):
        default_collate([Sample(torch.ones(1), 1, "a", {"w": None})] * 2)  # type: ignore[dict-item]


def test_dataclass_class_object_is_not_collated() -> None:
    with pytest.raises(TypeError, match="cannot collate"):
        default_collate([Sample, Sample])


# ------------------------------------------------------------------------------------------
# default_convert
# ------------------------------------------------------------------------------------------

CONVERT_CASES: dict[str, Any] = {
    "tensor": torch.arange(3),
    "ndarray": np.arange(6, dtype=np.float32).reshape(2, 3),
    "ndarray-bool": np.array([True, False]),
    "ndarray-str": np.array(["a", "b"]),
    "ndarray-object": np.array([object()], dtype=object),
    "np-float32": np.float32(1.5),
    "np-int64": np.int64(3),
    "np-bool": np.bool_(True),
    "np-str": np.str_("s"),
    "int": 3,
    "float": 1.5,
    "str": "abc",
    "bytes": b"abc",
    "none": None,
    "dict": {"a": np.zeros(2), "b": "x", "c": 1},
    "ordered-dict": collections.OrderedDict(a=np.ones(1)),
    "defaultdict": collections.defaultdict(list, a=np.ones(1)),
    "mappingproxy": types.MappingProxyType({"a": np.ones(1)}),
    "unbuildable-mapping": UnbuildableMapping({"a": np.ones(1)}, 0),
    "namedtuple": Point(np.array(0), np.array([1, 2])),
    "tuple": (np.zeros(2), "a"),
    "list": [np.zeros(2), [np.ones(1), 3]],
    "range": range(3),
    "custom-sequence": Pair([np.zeros(1), 1]),
    "masked-array": np.ma.array([1, 2], mask=[False, True]),
}


@pytest.mark.parametrize("data", list(CONVERT_CASES.values()), ids=list(CONVERT_CASES))
def test_default_convert_matches_torch(data: Any) -> None:
    ours = default_convert(data)
    ref = torch_default_convert(data)
    if isinstance(ref, np.ndarray):
        assert ours is data
    else:
        assert_same(ours, ref)


def test_default_convert_leaves_numpy_bytes_scalars_unchanged() -> None:
    value = np.bytes_(b"x")
    assert default_convert(value) is value


def test_default_convert_does_not_copy_tensors() -> None:
    tensor = torch.ones(2)
    assert default_convert(tensor) is tensor
