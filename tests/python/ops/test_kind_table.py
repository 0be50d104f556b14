"""The optimizer table (NOTE [optimizer table] in python/fusetrain/optim/_table.py) and every place derived
from it: the generated C++ and docs are current, the native library was built from it, each declared class
exists with the table's defaults in its signature and its name in the Trainer's and the SuperGradients
layer's tables and the optimizer case table, and each class's records and state follow its entry. A step
checks every group's record before it writes anything."""

import inspect

import pytest
import torch

import fusetrain
from fusetrain import optim
from fusetrain.compat.super_gradients.names import SG_OPTIMIZERS, lookup
from fusetrain.optim import _codegen, _kinds
from fusetrain.optim._table import CLASSES, DEFAULT, INTERNAL, KIND_TABLE, table_digest
from fusetrain.training.params import OPTIMIZERS, optimizer_class

from _optim_helpers import OPTIMS
from _test_helpers import REPO, kind_record, kind_step

# Every optimizer class with the keyword arguments that switch on each state its kind can keep.
STATE_CASES = [
    (optim.Adam, dict(amsgrad=True)), (optim.AdamW, {}), (optim.SGD, dict(momentum=0.9)), (optim.SGD, {}),
    (optim.Lion, {}), (optim.RMSprop, dict(momentum=0.9, centered=True)), (optim.RMSprop, dict(centered=True)),
    (optim.RMSpropTF, dict(momentum=0.9)), (optim.Adadelta, {}), (optim.RAdam, {}), (optim.NAdam, {}),
    (optim.Lamb, {}), (optim.AdamP, {}), (optim.Muon, {}),
]
IDS = [f"{cls.__name__}-{kw}" for cls, kw in STATE_CASES]


def test_the_generated_files_are_current():
    stale = _codegen.stale_files(REPO)
    assert not stale, f"stale generated files {stale}: run `python -m fusetrain.optim --write`"


def test_the_native_library_was_built_from_the_table():
    assert fusetrain._C.optim_table_digest() == table_digest()
    native = {k["name"]: k for k in fusetrain._C.optim_kinds()}
    assert set(native) == set(_kinds.KINDS) == {k.name for k in KIND_TABLE if k.form != INTERNAL}
    for name, kind in _kinds.KINDS.items():
        assert [f["name"] for f in native[name]["fields"]] == list(kind["field_names"])
        assert native[name]["value_fields"] == list(kind["value_fields"])
        assert native[name]["lean"] == kind["lean"]


def test_every_declared_optimizer_is_in_every_derived_place():
    """A class of the table is exported, selectable by name in training_params and in SuperGradients recipes,
    has a row in the optimizer case table and its line in the docs' generated tables."""
    docs = {f: open(f"{REPO}/docs/{f}").read() for f in ("optimizers.md", "cpp.md")}
    for name, (kind, decl) in CLASSES.items():
        cls = getattr(optim, name)
        assert name in optim.__all__ and optim.OPTIMIZERS[name] is cls
        assert cls._kind == kind.name and cls._decl is decl
        assert OPTIMIZERS[name] is cls and optimizer_class(name.lower()) is cls
        assert lookup(SG_OPTIMIZERS, name) == name
        assert OPTIMS[name].ours is cls
        if decl.torch is not None:
            assert OPTIMS[name].ref is getattr(torch.optim, decl.torch)
        assert f"| `{name}` |" in docs["optimizers.md"]
        assert f"| `{name}Options(lr=" in docs["cpp.md"]
    assert set(OPTIMIZERS) == set(CLASSES) == set(OPTIMS)


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_signature_shows_the_tables_defaults(name):
    kind, decl = CLASSES[name]
    params = inspect.signature(getattr(optim, name)).parameters
    assert params["lr"].default == decl.lr
    options = dict(kind.options_of(decl))
    for arg, p in params.items():
        assert p.default is not DEFAULT, arg
        if arg in options and arg != "adjust_lr_fn":  # Muon's is torch's None (the first choice)
            assert p.default == kind.option_default(decl, arg), arg
    opt = getattr(optim, name)([torch.nn.Parameter(torch.randn(2, 2))])
    assert opt.defaults["max_grad_norm"] == decl.max_grad_norm


def test_the_names_messages_list_are_the_tables():
    lean = [n for n, (k, _) in CLASSES.items() if k.lean]
    assert list(_kinds.LEAN_CLASSES) == lean
    with pytest.raises(ValueError, match=", ".join(lean)):
        optim.Lamb([torch.nn.Parameter(torch.randn(2))], master_weights="remainder")


@pytest.mark.parametrize("cls,kw", STATE_CASES, ids=IDS)
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
    with open(REPO + "/docs/ops.md") as f:
        section = _codegen.section_of(f.read())
    assert section == _codegen.render_ops_markdown()
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


@pytest.mark.parametrize("fields,match", [
    (dict(nesterov=1.0, momentum=0.0), "nesterov needs momentum > 0, got momentum=0"),
    (dict(nesterov=1.0, momentum=0.9, dampening=0.1), "nesterov needs dampening == 0, got dampening=0.1"),
    (dict(nesterov=0.5, momentum=0.9), "nesterov must be 0 or 1, got 0.5"),
    (dict(dampening=float("nan")), "dampening must be a finite number, got nan"),
    (dict(dampening=float("-inf")), "dampening must be a finite number, got -inf"),
    (dict(weight_decay=float("inf")), "weight_decay must be a finite number >= 0, got inf"),
])
def test_the_tables_rules_and_types_are_checked(fields, match):
    record = kind_record("sgd", **dict(dict(momentum=0.0, weight_decay=0.0), **fields))
    with pytest.raises(ValueError, match=match):
        torch.ops.fusetrain.fused_step_("sgd", [torch.randn(2)], [torch.randn(2)], [torch.zeros(())],
                                        [torch.zeros(2)] if fields.get("momentum") else [], [], [], [], [], [1],
                                        [torch.tensor(0.1)], record)


def test_a_group_without_a_record_field_is_named():
    opt = optim.Adam([torch.zeros(2, requires_grad=True)])
    del opt.param_groups[0]["eps"]
    with pytest.raises(KeyError, match="a param group has no 'eps', an option of the 'adam' record"):
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
