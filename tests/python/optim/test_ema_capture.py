"""NOTE [decay written under capture]: a constant EMA decay counts as written only once the write ran, so a CUDA
graph capture that is abandoned leaves the next eager step to write it (else the EMA would keep a decay of 0 and
copy the weights every step)."""

import pytest
import torch
from torch import nn

import fusetrain
from fusetrain import ema as ema_module

from _test_helpers import CUDA


def _model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def test_a_decay_written_while_capturing_is_written_again_afterwards(monkeypatch):
    ema = fusetrain.ModelEMA(_model(), decay=0.9, decay_type="constant")
    monkeypatch.setattr(ema_module, "_capturing", lambda t: True)  # a write recorded, not run
    ema._decay.zero_()
    ema._compute_decay()
    assert ema._decay_written is None
    monkeypatch.setattr(ema_module, "_capturing", lambda t: False)
    ema._decay.zero_()  # what an abandoned capture leaves: the write never ran
    ema._compute_decay()
    assert ema._decay.item() == pytest.approx(0.9) and ema._decay_written == (0.9,)
    ema._decay.fill_(-1.0)  # written once: a constant decay is not written again
    ema._compute_decay()
    assert ema._decay.item() == -1.0


@CUDA
def test_an_abandoned_capture_leaves_the_ema_decay_to_the_next_eager_step():
    model = _model("cuda")
    opt = fusetrain.optim.AdamW(model.parameters(), lr=1e-2)  # a Python-float lr: a capture raises
    ema = fusetrain.ModelEMA(model, decay=0.5, decay_type="constant").attach(opt)
    x = torch.randn(16, 4, device="cuda")
    model(x).square().mean().backward()  # no eager step yet: the capture would be the decay's first write
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.raises(Exception):
        with torch.cuda.stream(side), torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()
    torch.cuda.synchronize()
    before = {n: p.detach().clone() for n, p in ema.module.named_parameters()}
    opt.step()  # eager: the decay must be 0.5 again, not what the capture left
    torch.cuda.synchronize()
    assert ema.decay_tensor.item() == pytest.approx(0.5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(dict(ema.module.named_parameters())[n], 0.5 * before[n] + 0.5 * p.detach())
