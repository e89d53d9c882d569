"""Sharded checkpoints on DCP (parallel/checkpointing/dcp_chunks.py): the chunks of any split
and flat range tile the whole tensor exactly; a checkpoint saved at 4 ranks (tp=2, ZeRO
over dp=2) loads at 2 ranks (tp=2), at 4 ranks (tp=1, another flat split) and whole in
one process, exactly; bad requests and untrusted metadata fail clearly, before writing."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pycomm.parallel.checkpointing.dcp_chunks import (
    Chunk,
    ChunkedTensor,
    chunks_of,
    load,
    read_whole,
    save,
    saved_keys,
)
from pycomm.parallel.tensor.sharding import TPSpec
from pycomm.testing import RankPool, run_ranks
from tests import _dcp_scenarios as sc

F64 = torch.float64


# --- chunks_of against TPSpec.shard ------------------------------------------------------

@st.composite
def splits(draw):
    """A shape, its split, and ZeRO-like cut points of each rank's flat TP part."""
    ndim = draw(st.integers(1, 3))
    world = draw(st.integers(1, 4))
    interleave = draw(st.integers(1, 3))
    dim = draw(st.none() | st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(0, 4)) for _ in range(ndim)]
    if dim is not None:
        shape[dim] = interleave * world * draw(st.integers(0, 3))
    cuts = draw(st.lists(st.integers(0, 10**6), max_size=4))
    return tuple(shape), TPSpec(dim, interleave), world, cuts


def _tile(shape, spec, world, cuts):
    """Every rank's chunks of every range, written into one tensor: (the tensor, how
    many times each element was written). Asserts each chunk is a view of its range."""
    whole = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=F64).reshape(shape)
    got, hits = torch.zeros_like(whole), torch.zeros(shape, dtype=torch.int64)
    for rank in range(world):
        # TPSpec.shard cannot reshape an empty tensor; its part is empty too
        local = spec.shard(whole, world, rank).reshape(-1) if whole.numel() else whole.view(-1)
        n = local.numel()
        bounds = sorted({0, n, *(c % (n + 1) for c in cuts)})
        for lo, hi in itertools.pairwise(bounds):
            flat = local[lo:hi].clone()
            for c in chunks_of(shape, spec, world, rank, flat, lo):
                assert c.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                where = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.data.shape,
                                                               strict=True))
                got[where] = c.data
                hits[where] += 1
    return whole, got, hits


@settings(max_examples=200, deadline=None)
@given(splits())
def test_chunks_of_every_rank_and_range_tile_the_tensor_once(case):
    shape, spec, world, cuts = case
    whole, got, hits = _tile(shape, spec, world, cuts)
    assert torch.equal(got, whole)
    copies = world if spec.dim is None else 1  # a replicated tensor: whole on every rank
    assert (hits == copies).all()


def test_chunks_of_a_0d_tensor_and_an_empty_range():
    x = torch.tensor([3.0], dtype=F64)
    [c] = chunks_of((), TPSpec(), 2, 1, x, 0)
    assert c.offsets == () and c.data.shape == () and c.data.item() == 3.0
    assert chunks_of((), TPSpec(), 1, 0, x[:0], 1) == []
    assert chunks_of((4, 6), TPSpec(1), 2, 0, torch.zeros(0), 5) == []


def test_chunks_of_cuts_at_interleave_blocks():
    """Rank 1 of 2, Q|K|V blocks of 2 rows each: local rows 1..2 are global rows 3 and 6."""
    flat = torch.arange(2 * 3, dtype=F64)  # local rows 1 and 2 of a (6, 3) TP part
    chunks = chunks_of((12, 3), TPSpec(0, interleave=3), 2, 1, flat, 3)
    got = [(c.offsets, tuple(c.data.shape)) for c in chunks]
    assert got == [((3, 0), (1, 3)), ((6, 0), (1, 3))]


@pytest.mark.parametrize(("shape", "spec", "world", "flat", "start"), [
    ((6, 4), TPSpec(0), 4, torch.zeros(1), 0),  # 6 rows do not split over 4 ranks
    ((6, 4), TPSpec(0, interleave=2), 2, torch.zeros(1), 0),  # nor into 2 x 2 blocks
    ((6, 4), TPSpec(0), 2, torch.zeros(3), 10),  # past the 12 local elements
    ((6, 4), TPSpec(0), 2, torch.zeros(2, 2), 0),  # not 1-D
    ((6, 4), TPSpec(2), 2, torch.zeros(1), 0),  # no dim 2
])
def test_chunks_of_rejects_what_does_not_fit(shape, spec, world, flat, start):
    with pytest.raises(ValueError):
        chunks_of(shape, spec, world, 0, flat, start)


# --- one process: round trip, errors, untrusted metadata ---------------------------------

def _save_two_halves(path: Path, extra: dict | None = None) -> torch.Tensor:
    """A (4, 3) tensor saved as two chunks by one process, plus an object."""
    w = torch.randn(4, 3, dtype=F64)
    ct = ChunkedTensor(torch.Size((4, 3)), F64, [Chunk((0, 0), w[:1]), Chunk((1, 0), w[1:])])
    save({"w": ct, "obj": {"a": 1}, **(extra or {})}, path)
    return w


def test_one_process_round_trip_and_saved_keys(tmp_path):
    w = _save_two_halves(tmp_path / "c", extra={"e": torch.zeros(0, 3), "s": torch.tensor(2.5)})
    assert saved_keys(tmp_path / "c") == {"w": (torch.Size((4, 3)), F64), "obj": None,
                                          "e": (torch.Size((0, 3)), torch.float32),
                                          "s": (torch.Size(()), torch.float32)}
    got = read_whole(tmp_path / "c")
    assert torch.equal(got["w"], w) and got["obj"] == {"a": 1}
    assert got["e"].shape == (0, 3) and got["s"].item() == 2.5
    into = torch.zeros(2, 3, dtype=F64)
    objects = load({"w": ChunkedTensor((4, 3), F64, [Chunk((2, 0), into)]), "obj": 0},
                   tmp_path / "c")
    assert torch.equal(into, w[2:]) and objects == {"obj": {"a": 1}}
    assert not (tmp_path / "c.partial").exists()


def test_save_replaces_an_older_checkpoint(tmp_path):
    save({"x": torch.zeros(3), "old": 1}, tmp_path / "c")
    save({"x": torch.ones(3)}, tmp_path / "c")
    assert saved_keys(tmp_path / "c") == {"x": (torch.Size((3,)), torch.float32)}
    assert torch.equal(read_whole(tmp_path / "c")["x"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_save_refuses_chunks_that_do_not_tile(tmp_path):
    w = torch.zeros(4, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"'w'.*hold 9 elements of 12"):
        save({"w": ChunkedTensor((4, 3), F64, [Chunk((1, 0), w[1:])])}, tmp_path / "c")
    with pytest.raises(ValueError, match=r"'w'.*does not fit"):
        save({"w": ChunkedTensor((4, 3), F64, [Chunk((2, 0), w[1:])])}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


class Custom:
    pass


def test_objects_load_weights_only_unless_trusted(tmp_path):
    save({"o": Custom()}, tmp_path / "c")
    with pytest.raises(ValueError, match="Weights only load failed"):
        read_whole(tmp_path / "c")
    assert isinstance(read_whole(tmp_path / "c", weights_only=False)["o"], Custom)


def _tamper(path: Path, change) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _shift_chunk(md):
    md.state_dict_metadata["w"].chunks[1].offsets = torch.Size((2, 0))


def _drop_chunk(md):
    del md.state_dict_metadata["w"].chunks[0]


def _escape(md):
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere"


def _evil(md):
    md.planner_data = print  # any global beyond DCP's own classes


@pytest.mark.parametrize(("change", "message"), [
    (_shift_chunk, "'w': saved chunk at \\(2, 0\\) of size \\(3, 3\\) lies outside"),
    (_drop_chunk, "'w': the checkpoint does not hold the part at \\(0, 0\\)"),
    (_escape, "malformed storage entry"),
    (_evil, "builtins.print is not allowed"),
])
def test_untrusted_metadata_is_checked_before_reading(tmp_path, change, message):
    _save_two_halves(tmp_path / "c")
    _tamper(tmp_path / "c", change)
    with pytest.raises(ValueError, match=message):
        read_whole(tmp_path / "c")


# --- several ranks -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool4():
    with RankPool(4, backend="gloo", pg_timeout_s=60) as pool:
        yield pool


@pytest.fixture(scope="module")
def saved(pool4, tmp_path_factory):
    """A checkpoint saved at 4 ranks, tp=2 and ZeRO over dp=2 (uneven flat ranges)."""
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    pool4.run(sc.save_layout, path, 2, 2, True, 1)
    return path


@pytest.mark.parametrize("layout", [
    (2, 1, False, 0),  # 2 ranks (a subgroup of the 4), tp=2, no ZeRO
    (1, 4, True, -1),  # 4 ranks, tp=1, ZeRO over dp=4, another flat split
    (2, 2, True, 1),  # the saved layout itself
], ids=["tp2", "tp1-zero4", "same"])
def test_loads_in_another_layout_exactly(pool4, saved, layout):
    results = pool4.run(sc.load_layout, saved, *layout)
    ranks = layout[0] * layout[1]
    assert results[:ranks] == [[]] * ranks, results
    assert results[ranks:] == [None] * (4 - ranks)


def test_read_whole_assembles_every_tensor_in_one_process(saved):
    got = read_whole(saved)
    assert set(got) == {*sc.TENSORS, "rep", "meta"}
    for name in sc.TENSORS:
        assert torch.equal(got[name], sc.full(name)), name
    assert torch.equal(got["rep"], sc.replicated()) and got["meta"] == sc.OBJECT
    assert set(read_whole(saved, ["qkv"])) == {"qkv"}


def test_bad_loads_fail_on_every_rank_naming_the_key(pool4, saved):
    for rank, out in enumerate(pool4.run(sc.load_errors, saved)):
        message, untouched = out["missing"]
        assert "'no_such_key' is not in the checkpoint (rank 0, 1, 2, 3)" in message, rank
        message, untouched2 = out["shape"]
        assert "'w_row': the checkpoint holds a torch.float64 tensor of shape (8, 6), " \
               "this rank wants a torch.float64 tensor of shape (8, 7) (rank 1)" in message
        assert untouched and untouched2


def test_an_interrupted_save_is_no_checkpoint(pool4, saved, tmp_path):
    fresh = str(tmp_path / "fresh")
    out = pool4.run(sc.interrupted_save, saved, fresh)[0]
    assert out[saved] == out[fresh] == "CheckpointException"
    assert out["old"] == []
    assert f"no checkpoint at {fresh} ({fresh}.partial is a save that did not finish)" \
        in out["fresh"]
    assert Path(fresh + ".partial").is_dir() and not Path(fresh).exists()
    with pytest.raises(FileNotFoundError):
        saved_keys(fresh)


@pytest.mark.usefixtures("require_pycomm")
def test_on_the_pycomm_backend(tmp_path):
    """Save at 2 ranks (tp=1, ZeRO over dp=2) and load at tp=2, over pycomm."""
    path = str(tmp_path / "ckpt")
    assert run_ranks(sc.save_then_load, 2, path, backend="pycomm") == [[], []]
    for name in sc.TENSORS:
        assert torch.equal(read_whole(path)[name], sc.full(name))
