"""What a run shows on the console and keeps in its folder: the header before the first step (device,
precision as resolved and why, parameters, optimizer and schedule, step mode, folder), one line per epoch
(metrics with the watched one marked, lr, time, the files saved), the summary, console.log with the same
lines, training_params.yaml with the resolved params, and warnings attributed to the user's call."""

import os
import warnings

import yaml

from _train_helpers import one_thread, train  # noqa: F401  (fixture)


def test_header_epoch_lines_and_summary_on_the_console_and_in_the_run_folder(tmp_path, capsys):
    result, model = train(tmp_path, max_epochs=2, mixed_precision=True, optimizer="AdamW", initial_lr=0.01,
                          lr_mode="cosine", clip_grad_norm=5.0)
    out = capsys.readouterr().out
    run = result["run_dir"]
    n = sum(p.numel() for p in model.parameters())
    for line in (f"fusetrain: run {os.path.basename(run)} of experiment exp", f"  folder     {run}",
                 "  device     cpu (1 process)",
                 "  precision  bf16 autocast (mixed_precision=true -> bf16: the CPU has no fast fp16)",
                 f"  model      DigitsCNN: {n:,} trainable parameters of {n:,}",
                 "  optimizer  AdamW (lr 0.01, cosine schedule, clip_grad_norm 5)", "  step       eager"):
        assert line in out.splitlines(), (line, out)
    epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and all(" | lr " in e and "samples/s" in e for e in epochs)
    assert "valid_accuracy" in epochs[0] and "(best)" in epochs[0] and "saved ckpt_latest.pth, ckpt_best.pth" in \
        epochs[0]
    assert ("(best)" in epochs[1]) == (result["best"]["epoch"] == 2)
    assert "done: 2 epoch(s), 6 optimizer steps" in out  # QUICK: 3 batches an epoch
    assert f"  best valid_accuracy {result['best']['value']:.4f} at epoch {result['best']['epoch']}" in out
    with open(os.path.join(run, "console.log")) as f:
        logged = f.read().splitlines()
    assert epochs[0] in logged and epochs[1] in logged and any(line.startswith("done: ") for line in logged)
    with open(os.path.join(run, "training_params.yaml")) as f:
        saved = yaml.safe_load(f)
    assert saved["max_epochs"] == 2 and saved["optimizer"] == "AdamW" and saved["clip_grad_norm"] == 5.0


def test_a_compiled_step_says_that_its_first_steps_compile(tmp_path, capsys):
    # The header says so; the note after the first step is printed only when it compiles (not checked here).
    train(tmp_path, max_epochs=1, max_train_batches=1, compile_step="compile",
          torch_compile_options={"backend": "eager"})
    out = capsys.readouterr().out
    assert "  step       compiled step (torch.compile): the first steps compile, so the first epoch takes longer" \
        in out.splitlines()


def test_a_trainer_warning_points_at_the_users_call(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, max_epochs=1, sync_bn=True)  # not a distributed run: BatchNorm stays local
    mine = [w for w in caught if "sync_bn" in str(w.message)]
    # The first frame outside fusetrain: the helper's Trainer(...).train(...) line (NOTE [warnings at the user's
    # call]).
    assert mine and all(w.filename.endswith("_train_helpers.py") for w in mine), [w.filename for w in mine]
