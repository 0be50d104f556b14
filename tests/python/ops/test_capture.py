"""CUDA-graph capture of the whole step: what must hold before the first GPU run.

CPU: a stand-in for torch.cuda's stream/graph API records how TrainStep
captures (thread-local capture mode, the model's device current, one side
stream and pool for both graphs), and checks that every piece of optimizer
state exists before the capture, that an lr which a graph would pin is refused
before capturing, that a failed capture releases the allocator's pool, that the
results the host reads after a step live in buffers outside the graph's pool,
and that ``device: cuda:N`` becomes the current device. The stand-in runs the
captured code eagerly (a real capture runs nothing); these tests check the
orchestration, the GPU tests below the numbers.

GPU (skipped without one): a capture while another thread uses CUDA (pinned
host copies), a failed capture followed by ``empty_cache``, a parameter whose
first gradient comes after the warm-up, an lr replaced by a float, a CPU lr
tensor, result buffers under accumulation, and a model on a second GPU.
"""

import contextlib
import threading
import warnings

import pytest
import torch
from torch import nn

import fusetrain
from fusetrain import TrainStep
from fusetrain.optim import AdamW
from fusetrain.optim import _capture
from fusetrain.training import distributed as _dist
from fusetrain.training.step import train_step as step_mod
from _test_helpers import CUDA

LOSS = nn.CrossEntropyLoss()


class Late(nn.Module):
    """Uses its second layer only once ``use_late`` is set (a layer whose first
    gradient comes after the warm-up)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 5)
        self.use_late = False
        self.fail = None  # an exception to raise inside the next forward

    def forward(self, x):
        if self.fail is not None:
            raise self.fail
        h = self.a(x)
        return self.b(h) if self.use_late else h


def data(n, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g).to(device), torch.randint(0, 5, (4,), generator=g).to(device))
            for _ in range(n)]


def make(device="cpu", accumulate=1, precision="fp32", warmup_steps=1):
    torch.manual_seed(0)
    model = Late().to(device)
    lr = torch.tensor(0.01, device=device)
    opt = AdamW(model.parameters(), lr=lr, max_grad_norm=1.0)
    prec = fusetrain.resolve_precision(precision, device)
    scaler = prec.make_scaler(init_scale=2.0**8)
    ema = fusetrain.ModelEMA(model, decay=0.9, decay_type="threshold")
    step = TrainStep(model, LOSS, opt, scaler, prec, mode="cuda_graph" if device != "cpu" else "off",
                     accumulate=accumulate, ema=ema, warmup_steps=warmup_steps)
    return model, opt, scaler, ema, step


# ---- a stand-in for torch.cuda's capture API ------------------------------------------


class FakeCuda:
    """Records the torch.cuda calls of TrainStep's capture path; the captured
    code runs eagerly on the CPU, with ``capturing`` set meanwhile."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.device_stack = []
        self.capturing = False
        self.end_fails = False  # capture_end raises (as after a CUDA error inside the capture)
        self.streams = {}
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.device = device
                fake.calls.append(("Stream", device))

            def wait_stream(self, other):
                pass

        class Graph:
            def __init__(self):
                self.ended = False
                self.replays = 0

            def replay(self):
                self.replays += 1

            def pool(self):
                if not self.ended:
                    raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
                return (0, 42)

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            fake.calls.append(("graph", g, pool, stream, capture_error_mode, list(fake.device_stack)))
            fake.capturing = True
            try:
                yield
            except BaseException:
                fake.capturing = False
                if fake.end_fails:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                g.ended = True
                raise
            fake.capturing = False
            g.ended = True

        @contextlib.contextmanager
        def device(d):
            fake.device_stack.append(torch.device(d))
            try:
                yield
            finally:
                fake.device_stack.pop()

        @contextlib.contextmanager
        def stream(s):
            yield

        def current_stream(device=None):
            return fake.streams.setdefault(str(device), Stream.__new__(Stream))

        self.Graph = Graph
        for name, value in dict(Stream=Stream, CUDAGraph=Graph, graph=graph, device=device, stream=stream,
                                current_stream=current_stream, graph_pool_handle=lambda: (0, 42),
                                set_stream=lambda s: fake.calls.append(("set_stream", s)),
                                synchronize=lambda device=None: None).items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(_capture, "capturing", lambda device: fake.capturing)
        monkeypatch.setattr(fusetrain._ops, "abandon_capture",
                            lambda device, pool: fake.calls.append(("abandon_capture", device, pool)))
        # The model stays on the CPU: let TrainStep build a graphed step there.
        monkeypatch.setattr(TrainStep, "_check_capturable", lambda self, opt: None)

    def of(self, kind):
        return [c for c in self.calls if c[0] == kind]


@pytest.fixture
def fake_cuda(monkeypatch):
    return FakeCuda(monkeypatch)


def graphed(accumulate=1, warmup_steps=1):
    model, opt, scaler, ema, _ = make(accumulate=accumulate)
    step = TrainStep(model, LOSS, opt, scaler, fusetrain.resolve_precision("fp32", "cpu"), mode="cuda_graph",
                     accumulate=accumulate, ema=ema, warmup_steps=warmup_steps)
    return model, opt, step


def test_capture_is_thread_local_on_the_model_device_with_one_stream_and_pool(fake_cuda):
    model, opt, step = graphed(accumulate=2)
    for x, y in data(6):
        step(x, y)
    graphs = fake_cuda.of("graph")
    assert len(graphs) == 2, "one micro-step graph and one full-step graph"
    for _, g, pool, stream, mode, devices in graphs:
        assert mode == "thread_local"
        assert stream is step._side_stream, "captured on the side stream"
        assert pool == (0, 42)
        assert devices == [step.device], "captured with the model's device current"
    assert graphs[0][3] is graphs[1][3], "both graphs on the same stream"
    assert fake_cuda.of("Stream") == [("Stream", step.device)], "one side stream, made on the model's device"
    assert set(step._graphs) == {False, True}


def test_every_trainable_param_has_state_before_the_capture(fake_cuda):
    model, opt, step = graphed(accumulate=1)
    batches = data(4)
    step(*batches[0])  # warm-up: layer b gets no gradient
    assert model.b.weight not in opt.state
    model.use_late = True  # b's first gradient comes inside the capture
    step(*batches[1])  # captured: _init_group would raise if it had to create b's state now
    for p in model.parameters():
        assert set(opt.state[p]) >= {"step", "exp_avg", "exp_avg_sq"}
    assert step.captured


def test_first_gradient_inside_capture_with_accumulation_is_refused(fake_cuda):
    model, opt, step = graphed(accumulate=2)
    batches = data(6)
    step(*batches[0])
    step(*batches[1])  # warm-up optimizer step
    model.use_late = True
    with pytest.raises(RuntimeError, match=r"2 parameter\(s\) got their first gradient inside the CUDA-graph capture"
                                           r".*overwrite instead of accumulate.*invalidate\(\)"):
        step(*batches[2])
    assert model.b.weight.grad is None, "the graph's gradient tensor is not left behind"
    assert not step.captured


def test_state_created_while_capturing_raises(monkeypatch):
    model = Late()
    opt = AdamW(model.parameters(), lr=torch.tensor(0.01))
    LOSS(model(torch.randn(3, 6)), torch.tensor([0, 1, 2])).backward()
    monkeypatch.setattr(_capture, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=r"param 0 of group 0 has no optimizer state yet and a CUDA graph is being "
                                           r"captured.*prepare_capture\(\)"):
        opt.step()
    monkeypatch.setattr(_capture, "capturing", lambda device: False)
    opt.prepare_capture()
    monkeypatch.setattr(_capture, "capturing", lambda device: True)
    opt.step()  # everything exists: nothing to create
    assert opt.state[model.a.weight]["step"].item() == 1
    assert opt.state[model.b.weight]["step"].item() == 0, "prepared, not stepped (it has no gradient)"


def test_prepared_state_changes_no_step():
    torch.manual_seed(3)
    a, b = Late(), Late()
    b.load_state_dict(a.state_dict())
    oa, ob = AdamW(a.parameters(), lr=0.01), AdamW(b.parameters(), lr=0.01)
    ob.param_groups[0]["lr"] = torch.tensor(0.01)
    oa.param_groups[0]["lr"] = torch.tensor(0.01)
    ob.prepare_capture()
    for x, y in data(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            LOSS(m(x), y).backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_float_lr_is_refused_before_capture(fake_cuda):
    model, opt, step = graphed()
    batches = data(3)
    step(*batches[0])  # warm-up
    opt.param_groups[0]["lr"] = 0.01  # replaced by a float after construction
    with pytest.raises(ValueError, match=r"param group 0's lr is the Python number 0.01.*would keep the value of the "
                                         r"capture.*torch.tensor\(value, device='cpu'\)"):
        step(*batches[1])
    assert not fake_cuda.of("graph"), "refused before capturing"


def test_float_lr_filled_while_capturing_raises(monkeypatch):
    model = Late()
    opt = AdamW(model.parameters(), lr=0.01)
    LOSS(model(torch.randn(3, 6)), torch.tensor([0, 1, 2])).backward()
    opt.step()
    monkeypatch.setattr(_capture, "capturing", lambda device: True)
    opt.param_groups[0]["lr"] = 0.02  # a fill of the cached lr tensor would be recorded
    with pytest.raises(RuntimeError, match=r"lr is the Python number 0.02 and a CUDA graph is being captured"):
        opt.step()


def test_cpu_lr_tensor_for_gpu_params_warns_once_and_is_refused_while_capturing(monkeypatch):
    model = Late()
    opt = AdamW(model.parameters(), lr=torch.tensor(0.01))
    lr, dev = opt.param_groups[0]["lr"], torch.device("cuda", 0)
    monkeypatch.setattr(_capture, "capturing", lambda device: False)
    with pytest.warns(UserWarning, match=r"lr is a CPU tensor but its params are on cuda:0: every step copies it"):
        opt._check_lr_copy(0, lr, dev)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt._check_lr_copy(0, lr, dev)  # once
    monkeypatch.setattr(_capture, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=r"lr is a tensor on cpu but its params are on cuda:0, and a CUDA graph"):
        opt._check_lr_copy(0, lr, dev)


@pytest.mark.parametrize("end_fails", [True, False])
def test_failed_capture_releases_the_pool_and_restores_state(fake_cuda, end_fails):
    model, opt, step = graphed()
    batches = data(3)
    step(*batches[0])  # warm-up
    last = dict(opt._last)
    fake_cuda.end_fails = end_fails
    model.fail = RuntimeError("operation not permitted when stream is capturing")
    with pytest.raises(RuntimeError, match=r"could not be captured as a CUDA graph \(RuntimeError: operation not "
                                           r"permitted when stream is capturing\)"):
        step(*batches[1])
    released = fake_cuda.of("abandon_capture")
    if end_fails:  # capture_end stopped before ending the pool's use: released by hand
        assert released == [("abandon_capture", step.device, (0, 42))]
    else:  # the capture ended: the graph releases its pool when dropped
        assert released == []
    assert fake_cuda.of("set_stream"), "the current stream is restored"
    assert opt._last == last
    assert step._graphs == {} and step._pool is None
    assert step.scaler._per_optimizer == {}
    model.fail = None
    fake_cuda.end_fails = False
    step(*batches[2])  # a later capture works
    assert step.captured


def test_step_results_live_outside_the_graph_pool(fake_cuda):
    model, opt, step = graphed(accumulate=2)
    bufs = dict(opt._results)  # made with the optimizer, before any capture
    for x, y in data(6):
        step(x, y)
    assert opt.last_grad_norm is bufs["grad_norm"] and opt.last_found_inf is bufs["found_inf"]
    assert opt.last_grad_norm.item() > 0  # written by the captured step (run eagerly by the stand-in)
    # an eager step of another shape writes the same tensors, and so does the next replay
    step(torch.randn(3, 6), torch.tensor([0, 1, 2]), last=True)
    assert opt.last_grad_norm is bufs["grad_norm"]
    x, y = data(1, seed=5)[0]
    step(x, y)
    step(x, y)
    assert opt.last_grad_norm is bufs["grad_norm"] and opt.last_found_inf is bufs["found_inf"]


def test_cuda_device_becomes_current(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(d))
    assert _dist.single_device("cuda:1") == torch.device("cuda", 1)
    assert _dist.single_device("cuda") == torch.device("cuda", 0)
    assert _dist.single_device("auto") == torch.device("cuda", 0)
    assert chosen == [1, 0, 0]
    with pytest.raises(ValueError, match=r"training_params.device: got 'cuda:2' but only 2 CUDA device\(s\) are "
                                         r"visible.*allowed: 'cuda:0' to 'cuda:1'"):
        _dist.single_device("cuda:2")
    assert _dist.single_device("cpu") == torch.device("cpu")


# ---- GPU ------------------------------------------------------------------------------


def run_pair(accumulate, n, warmup_steps=1, precision="fp32", use_late_from=None):
    """An eager and a captured run over the same batches; returns both."""
    runs = []
    for mode in ("off", "cuda_graph"):
        model, opt, scaler, ema, _ = make("cuda", accumulate, precision)
        step = TrainStep(model, LOSS, opt, scaler, fusetrain.resolve_precision(precision, "cuda"), mode=mode,
                         accumulate=accumulate, ema=ema, warmup_steps=warmup_steps)
        for i, (x, y) in enumerate(data(n, "cuda")):
            model.use_late = use_late_from is not None and i >= use_late_from
            step(x, y)
        torch.cuda.synchronize()
        runs.append((model, opt, step))
    return runs


def assert_same(a, b):
    for (n, pa), pb in zip(a[0].state_dict().items(), b[0].state_dict().values()):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    for pa, pb in zip(a[0].parameters(), b[0].parameters()):
        for k, v in a[1].state[pa].items():
            torch.testing.assert_close(b[1].state[pb][k], v, rtol=1e-5, atol=1e-6)


@CUDA
def test_gpu_capture_survives_another_thread_using_cuda():
    stop = threading.Event()
    errors = []  # an exception in a thread is only printed: collect it

    def pin_and_copy():  # what a DataLoader's pin-memory thread does
        try:
            while not stop.is_set():
                # Not randn: a draw from the global generator here would change the seeded models.
                t = torch.ones(1 << 16).pin_memory()
                t.to("cuda", non_blocking=True)
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    worker = threading.Thread(target=pin_and_copy, daemon=True)
    worker.start()
    try:
        eager, graph = run_pair(1, 12)
    finally:
        stop.set()
        worker.join()
    assert not errors, f"the other thread failed: {errors[0]!r}"
    assert graph[2].captured
    assert_same(eager, graph)


@CUDA
def test_gpu_failed_capture_leaves_the_allocator_usable():
    model, opt, scaler, ema, step = make("cuda")
    batches = data(3, "cuda")
    step(*batches[0])

    def syncing(x):
        out = nn.Linear.forward(model.a, x)
        if out.sum().item() > 1e9:  # a host sync: capture fails
            out = out * 2
        return out

    model.a.forward = syncing
    with pytest.raises(RuntimeError, match="could not be captured"):
        step(*batches[1])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= base, "empty_cache frees memory again after a failed capture"
    del model.a.forward
    step(*batches[2])  # captures now
    assert step.captured


@CUDA
def test_gpu_param_with_first_gradient_after_warmup():
    # b's first gradient comes in the captured call (the one after the warm-up); prepare_capture made
    # its state, and the replays match the eager steps. (A layer that joins the forward after the
    # capture is outside what a captured graph can replay.)
    eager, graph = run_pair(1, 6, use_late_from=1)
    assert graph[2].captured
    assert_same(eager, graph)
    with pytest.raises(RuntimeError, match="got their first gradient inside the CUDA-graph capture"):
        run_pair(2, 8, use_late_from=3)


@CUDA
def test_gpu_lr_pinned_by_a_capture_is_refused():
    model, opt, scaler, ema, step = make("cuda")
    batches = data(3, "cuda")
    step(*batches[0])
    opt.param_groups[0]["lr"] = 0.01
    with pytest.raises(ValueError, match="would keep the value of the capture"):
        step(*batches[1])
    opt.param_groups[0]["lr"] = torch.tensor(0.01)  # on the CPU
    with pytest.raises(ValueError, match=r"lr is a tensor on cpu, but a captured step reads it on cuda:0"):
        step(*batches[1])


@CUDA
def test_gpu_cpu_lr_tensor_warns_once_in_eager_steps():
    model = Late().cuda()
    opt = AdamW(model.parameters(), lr=torch.tensor(0.01))
    with pytest.warns(UserWarning, match="lr is a CPU tensor"):
        for x, y in data(2, "cuda"):
            LOSS(model(x), y).backward()
            opt.step()


@CUDA
def test_gpu_step_results_survive_micro_step_replays():
    model, opt, scaler, ema, step = make("cuda", accumulate=2, precision="fp16")
    batches = data(9, "cuda")
    # Calls 0-1 warm up, 2 captures the micro-step, 3 the step; 4 is a last=True step (a step graph
    # replayed where a micro-step would come: replay order differs from capture order).
    for i, (x, y) in enumerate(batches[:5]):
        step(x, y, last=(i == 4))
    norm = opt.last_grad_norm.clone()
    assert opt.last_grad_norm is opt._results["grad_norm"]
    step(*batches[5])  # a micro-step replay (the accumulation starts again after a last=True step)
    assert torch.equal(opt.last_grad_norm, norm)
    step(*batches[6])  # the step replay writes the next norm
    assert not torch.equal(opt.last_grad_norm, norm)


@CUDA
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_model_on_second_device_is_captured_there():
    torch.cuda.set_device(0)
    runs = []
    for mode in ("off", "cuda_graph"):
        model, opt, scaler, ema, _ = make("cuda:1")
        step = TrainStep(model, LOSS, opt, scaler, fusetrain.resolve_precision("fp32", "cuda"), mode=mode, ema=ema,
                         warmup_steps=1)
        for x, y in data(5, "cuda:1"):
            step(x, y)
        torch.cuda.synchronize(1)
        runs.append((model, opt, step))
    assert torch.cuda.current_device() == 0
    assert_same(*runs)
