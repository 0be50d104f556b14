"""Constants shared by the test modules: ``from _test_helpers import DEVICES``
(pytest puts tests/python on sys.path, as for the other ``_*_helpers``
modules; not named ``_common``, which is the benchmark scripts' own helper
module). Fixtures every module gets are in conftest.py."""

import os

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TESTS = os.path.dirname(os.path.abspath(__file__))  # tests/python: the helpers and child scripts

#: Skips a test (with the reason) on a machine without a usable CUDA GPU.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

#: ``@pytest.mark.parametrize("device", DEVICES)``: the CPU path always runs,
#: the CUDA one where a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def outcome(fn):
    """``(exception type, message)`` of calling ``fn``, or None when it returns:
    to compare what fusetrain and torch do with the same arguments."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the comparison is the point
        return type(e), str(e)
    return None


def bf16_master_twins(base):
    """float32 reference params holding the bf16 values of ``base``, and bf16 params for master weights."""
    return ([b.to(torch.bfloat16).float().requires_grad_() for b in base],
            [b.to(torch.bfloat16).requires_grad_() for b in base])


def check_bf16_master_follows_float32(ref_opt, ours_opt, ref_params, ours_params, steps, **tol):
    """Steps a float32 reference and a master-weights optimizer of bf16 params on the same bf16 gradients;
    the masters must follow the reference and the params be the masters rounded."""
    for i in range(steps):
        g = torch.Generator().manual_seed(900 + i)
        for p, q in zip(ref_params, ours_params):
            gr = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            p.grad, q.grad = gr.float(), gr
        ref_opt.step()
        ours_opt.step()
    for p, q in zip(ref_params, ours_params):
        torch.testing.assert_close(ours_opt.state[q]["master_param"], p.detach(), **tol)
        assert torch.equal(q, ours_opt.state[q]["master_param"].to(torch.bfloat16))


def check_skipped_step(opt, params, bad: float = float("inf")):
    """Puts a non-finite value into the second param's gradient and steps: nothing of the params or of the
    first param's state may change, and the step reports the flag."""
    params[1].grad[0] = bad
    before = [p.detach().clone() for p in params], {k: v.clone() for k, v in opt.state[params[0]].items()}
    opt.step()
    assert opt.last_found_inf.item() == 1.0
    assert all(torch.equal(p, c) for p, c in zip(params, before[0]))
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in before[1].items())


def step_with_schedule_clip_and_skip(ref_opt, ours_opt, ref_params, ours_params, clip_ref=True,
                                     bad: float = float("inf")):
    """Six steps of both optimizers under StepLR(step_size=2, gamma=0.5) on the same gradients: the reference
    clipped to norm 0.5 by clip_grad_norm_ (unless ``clip_ref`` is False: it clips inside its step), ours by its
    own max_grad_norm; at step 3 a non-finite gradient, which ours skips on the device (check_skipped_step) and
    the reference is not stepped for."""
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref_opt, ours_opt)]
    for i in range(6):
        g = torch.Generator().manual_seed(70 + i)
        grads = [torch.randn(p.shape, generator=g) * 4 for p in ref_params]
        for p, q, gr in zip(ref_params, ours_params, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        if i == 3:
            check_skipped_step(ours_opt, ours_params, bad)
        else:
            if clip_ref:
                torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
            ref_opt.step()
            ours_opt.step()
        for s in sched:
            s.step()


def _kind_defaults():
    """Each kind's record fields at the optimizer table's defaults (a choice at its first value's index)."""
    from fusetrain.optim._table import KIND_TABLE

    return {k.name: {f.name: (f.choices.index(f.default) if f.type == "choice" else f.default) for f in k.fields}
            for k in KIND_TABLE}


#: The record fields that kind_step fills in when a call does not name them: the optimizer table's defaults.
KIND_DEFAULTS = _kind_defaults()


def kind_record(kind, *, max_grad_norm=0.0, master=False, ema=False, maximize=False, **fields):
    """A group record of ``fusetrain::fused_step_`` built by field name from the kind table (``betas`` gives
    beta1 and beta2): the common fields, then the kind's own in the table's order."""
    if "betas" in fields:
        fields["beta1"], fields["beta2"] = fields.pop("betas")
    from fusetrain.optim._kinds import KINDS

    names = KINDS[kind]["field_names"]
    values = dict(KIND_DEFAULTS.get(kind, {}), **fields)
    unknown = set(values) - set(names)
    missing = set(names) - set(values)
    if unknown or missing:
        raise TypeError(f"kind_record({kind!r}): unknown fields {sorted(unknown)}, missing {sorted(missing)}")
    return [float(max_grad_norm), float(master), float(ema), float(maximize)] + [float(values[n]) for n in names]


def kind_step_args(kind, params, grads, steps, states=(), masters=(), emas=(), *, lr, maximize=False,
                   inv_scale=None, found_inf=None, grad_norm=None, max_grad_norm=0.0, ema_decay=None, **fields):
    """The arguments of one ``fusetrain::fused_step_`` call for one group of optimizer ``kind``: ``states``
    are its state lists state1..3 (those the record uses), ``masters`` one per float16/bfloat16 param,
    ``grad_norm`` a given clipping norm; the record is ``kind_record`` of the other arguments."""
    lists = [list(s) for s in states] + [[] for _ in range(3 - len(states))]
    record = kind_record(kind, max_grad_norm=max_grad_norm, master=bool(masters), ema=bool(emas), maximize=maximize,
                         **fields)
    args = (kind, list(params), list(grads), list(steps), *lists, list(masters), list(emas), [len(params)], [lr],
            record)
    kwargs = dict(inv_scale=inv_scale, found_inf=found_inf, ema_decay=ema_decay,
                  grad_norm=grad_norm if max_grad_norm > 0 else None)
    return args, kwargs


def kind_step(*args, **kwargs):
    """One ``fusetrain::fused_step_`` call of ``kind_step_args(*args, **kwargs)``."""
    a, kw = kind_step_args(*args, **kwargs)
    torch.ops.fusetrain.fused_step_(*a, **kw)


def latest_run(experiment_dir):
    """The newest run folder of an experiment (NOTE [run folders]); the experiment folder itself when it has
    none."""
    from fusetrain.training.checkpoint.run_folder import run_folders

    runs = run_folders(str(experiment_dir))
    return runs[-1] if runs else str(experiment_dir)


def run_path(root, experiment, name):
    """The file ``name`` of experiment ``experiment``'s newest run under ``root``."""
    return os.path.join(latest_run(os.path.join(str(root), experiment)), name)
