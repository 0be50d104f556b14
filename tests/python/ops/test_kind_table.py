"""The C++ kind table of fusetrain::fused_step_ (NOTE [kind table] in
csrc/ops/optim_kind.h) and what reads it: each optimizer class's records and
state come from its entry, the record section of docs/ops.md is generated from
it, and a step checks every group's record before it writes anything."""

import pytest
import torch

import fusetrain
from fusetrain import optim
from fusetrain.optim import _kinds

from _test_helpers import REPO, kind_record, kind_step

# Every optimizer class with the keyword arguments that switch on each state its kind can keep.
CLASSES = [
    (optim.Adam, dict(amsgrad=True)), (optim.AdamW, {}), (optim.SGD, dict(momentum=0.9)), (optim.SGD, {}),
    (optim.Lion, {}), (optim.RMSprop, dict(momentum=0.9, centered=True)), (optim.RMSprop, dict(centered=True)),
    (optim.RMSpropTF, dict(momentum=0.9)), (optim.Adadelta, {}), (optim.RAdam, {}), (optim.NAdam, {}),
    (optim.Lamb, {}), (optim.AdamP, {}), (optim.Muon, {}),
]
IDS = [f"{cls.__name__}-{kw}" for cls, kw in CLASSES]


def test_every_kind_is_an_optimizer_class():
    assert {cls._kind for cls, _ in CLASSES} == set(_kinds.KINDS)
    for kind in _kinds.KINDS.values():
        assert kind["fields"] and all(f["type"] in ("real", "flag", "int") for f in kind["fields"])
        assert len(set(kind["field_names"])) == len(kind["field_names"])


@pytest.mark.parametrize("cls,kw", CLASSES, ids=IDS)
def test_records_and_state_follow_the_table(cls, kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = cls(model.parameters(), lr=1e-2, **kw)
    kind = _kinds.KINDS[cls._kind]
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    for group in opt.param_groups:
        record = opt._kind_fields(group)
        assert len(record) == len(kind["field_names"])
        values = dict(zip(kind["field_names"], record))
        kept = {s["name"] for s in kind["states"]
                if s["when"] is None or (values[s["when"]] != 0.0) == s["when_set"]}
        for p in group["params"]:
            assert set(opt.state[p]) - {"step", "master_param"} == kept


def test_the_docs_record_section_is_generated_from_the_table():
    text = (REPO + "/docs/ops.md")
    with open(text) as f:
        section = _kinds.section_of(f.read())
    assert section == _kinds.render_markdown(), (
        "the record section of docs/ops.md is stale: replace it with the output of "
        "`python -m fusetrain.optim --markdown`")
    for kind in _kinds.KINDS.values():
        for field in kind["field_names"]:
            assert f"| `{field}` |" in section


def test_an_unknown_kind_names_the_kinds():
    p = [torch.zeros(2)]
    with pytest.raises(ValueError, match="optimizer must be one of 'adadelta', 'adam', .*'sgd', got 'adagrad'"):
        torch.ops.fusetrain.fused_step_("adagrad", p, p, [torch.zeros(())], [], [], [], [], [], [1],
                                        [torch.tensor(0.1)], [0.0] * 4)


def test_every_record_is_checked_before_anything_is_written():
    a, b = torch.randn(4), torch.randn(3)
    ga, gb = torch.randn(4), torch.randn(3)
    steps = [torch.zeros(()), torch.zeros(())]
    before = a.clone(), b.clone()
    good = kind_record("sgd", momentum=0.0, weight_decay=0.0)
    bad = kind_record("sgd", momentum=-1.0, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"fused_step_ \(sgd, group 1\): momentum must be >= 0, got -1"):
        torch.ops.fusetrain.fused_step_("sgd", [a, b], [ga, gb], steps, [], [], [], [], [], [1, 1],
                                        [torch.tensor(0.1)] * 2, good + bad)
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    assert all(s.item() == 0.0 for s in steps)


def test_a_group_without_a_record_field_is_named():
    opt = optim.Adam([torch.zeros(2, requires_grad=True)])
    del opt.param_groups[0]["eps"]
    with pytest.raises(KeyError, match="a param group has no 'eps', a field of the 'adam' record"):
        opt._kind_fields(opt.param_groups[0])


def test_kind_step_runs_a_kind_by_field_names():
    # The "adam" kind with AdamW's fields is torch's AdamW step.
    p = torch.randn(5)
    g = torch.randn(5)
    ref = p.clone().requires_grad_()
    ref.grad = g.clone()
    torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1).step()
    m, v = torch.zeros(5), torch.zeros(5)
    kind_step("adam", [p], [g], [torch.zeros(())], ([m], [v]), lr=torch.tensor(0.01), betas=(0.9, 0.999),
              eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)
    torch.testing.assert_close(p, ref.detach())
    assert fusetrain._ops.optim_kinds() == fusetrain._C.optim_kinds()
