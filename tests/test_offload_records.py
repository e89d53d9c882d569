"""The offload's unit records and unit step on one device, without ranks: a record written
to a store and read back is the same bytes (host memory and files), and a unit stepped
from its record by ``unit_stepper`` equals AdamW stepping the same tensors in memory,
bit for bit, over several steps. On the CPU always; on a CUDA GPU (``pytest -m gpu``) the
same code with the records copied to and from the device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pycomm.parallel.zero.offload_step import unit_stepper
from pycomm.parallel.zero.param_groups import Piece
from pycomm.parallel.zero.unit_store import FileUnitStore, HostUnitStore, Record, RecordLayout

FIELDS = ("master", "exp_avg", "exp_avg_sq")
NUMEL = 1000  # not a whole 4 KiB block: the padding is exercised
DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU")]),
]


def _store(kind: str, tmp_path, layouts):
    return FileUnitStore(str(tmp_path), 0, layouts) if kind == "disk" else HostUnitStore(layouts)


@pytest.mark.parametrize("kind", ["disk", "cpu"])
@pytest.mark.parametrize("device", DEVICES)
def test_record_round_trip(kind, device, tmp_path):
    layouts = [RecordLayout(NUMEL, torch.float32, FIELDS), RecordLayout(7, torch.float32, FIELDS)]
    store = _store(kind, tmp_path, layouts)
    wrote = Record(layouts[0], torch.device(device))
    values = {f: torch.randn(NUMEL, device=device) for f in FIELDS}
    for f in FIELDS:
        wrote.field(f).copy_(values[f])
    wrote.to_host(0, 3)
    store.write(0, wrote, 0, 3)
    for first, count in ((0, 1), (0, 3), (2, 1)):  # a forward reads the master alone
        read = Record(layouts[0], torch.device(device))
        store.read(0, read, first, count)
        read.to_device(first, count)
        for f in FIELDS[first : first + count]:
            assert torch.equal(read.field(f), values[f])
    assert store.bytes_written == 3 * layouts[0].field_bytes
    assert not list(tmp_path.iterdir())  # unlinked once open
    store.close()


OPTIMIZERS = {  # name -> (class, options): per-element state of every kind
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "rmsprop-centered": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5,
                                               "centered": True}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unit_step_matches_the_optimizer_in_memory(name, device):
    """The record holds the state the optimizer keeps (found by a probe step); 4 unit
    steps give the values and state of the same optimizer on the pieces in memory."""
    from pycomm.parallel.zero.offload_step import optimizer_state_layout

    cls, options = OPTIMIZERS[name]
    fields, _ = optimizer_state_layout(cls, options)
    assert fields  # every one of these keeps per-element state
    torch.manual_seed(0)
    start = torch.randn(NUMEL, device=device)
    pieces = [Piece(0, 0, 600, 0), Piece(0, 600, NUMEL, 1)]  # two groups' options
    groups = [{"weight_decay": 0.1}, {"weight_decay": 0.0}]

    def params(values: torch.Tensor) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(values[p.start : p.stop].clone()) for p in pieces]

    def build(members: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return cls([{**g, "params": [q]} for g, q in zip(groups, members, strict=True)],
                   **options)

    ref = params(start)
    ref_opt = build(ref)
    empties = [torch.nn.Parameter(torch.empty(0, device=device)) for _ in pieces]
    step = unit_stepper(build(empties), pieces, empties, lambda: None, fields)
    record = Record(RecordLayout(NUMEL, torch.float32, ("master", *fields)),
                    torch.device(device))
    record.data.zero_()
    record.field("master").copy_(start)
    unit = SimpleNamespace(index=0)
    for k in range(4):
        grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(k)).to(device)
        for p, q in zip(pieces, ref, strict=True):
            q.grad = grad[p.start : p.stop].clone()
        ref_opt.step()
        step(unit, grad, record)  # type: ignore[arg-type]
        got = record.field("master")
        for p, q in zip(pieces, ref, strict=True):
            assert torch.equal(got[p.start : p.stop], q.detach())
            for field in fields:
                want = ref_opt.state[q][field]
                assert torch.equal(record.field(field)[p.start : p.stop], want), field
    assert all(q.numel() == 0 and q.grad is None for q in empties)  # nothing kept between


def test_refuses_optimizers_whose_state_it_cannot_hold():
    from pycomm.parallel.zero.offload_step import optimizer_state_layout

    with pytest.raises(ValueError, match=r"LBFGS.*cannot step one parameter alone"):
        optimizer_state_layout(torch.optim.LBFGS, {"lr": 1.0})  # it needs a closure
    q = [torch.nn.Parameter(torch.empty(0))]
    sgd = torch.optim.SGD(q, lr=1.0, momentum=0.9)
    with pytest.raises(ValueError, match=r"records hold optimizer state \['exp_avg', "
                                         r"'exp_avg_sq'\]; SGD keeps \['momentum_buffer'\]"):
        unit_stepper(sgd, [Piece(0, 0, 0, 0)], q, lambda: None, ("exp_avg", "exp_avg_sq"))


def test_the_ram_case_is_the_shallowest_over_3x_the_ram(tmp_path, monkeypatch):
    """bench.offload ram's model: state >= 3x the RAM given, one block fewer is not; and
    a folder without room for its unit files is refused before anything runs."""
    import shutil

    from bench.offload import _check_disk, param_count, ram_case, state_bytes

    ram = 2 << 30  # 8 blocks of width 2048: quick to count on the meta device
    case = ram_case(ram)
    assert state_bytes(case) >= 3 * ram > state_bytes({**case, "n_layer": case["n_layer"] - 1})
    small = {**case, "n_layer": 1}
    free = 12 * param_count(small)  # just too little: 5% is kept in reserve
    monkeypatch.setattr("shutil.disk_usage", lambda _: shutil._ntuple_diskusage(free, 0, free))
    with pytest.raises(SystemExit, match="unit files need"):
        _check_disk(str(tmp_path), small)


def test_fields_are_read_and_written_in_runs_of_neighbours():
    from pycomm.parallel.zero.offload import field_spans

    layout = RecordLayout(NUMEL, torch.float32, (*FIELDS, "grad"))
    assert field_spans(layout, ("master",)) == [(0, 1)]
    assert field_spans(layout, ("grad", "master")) == [(0, 1), (3, 1)]
    assert field_spans(layout, ("master", "exp_avg", "exp_avg_sq")) == [(0, 3)]
    assert field_spans(layout, layout.fields) == [(0, 4)]
