"""The defects that the first GPU run showed (issue 54, torch 2.11 + CUDA 13.0 on an H200), each tested where it
can be: on this CPU, through the same code the CUDA path takes.

- HAR/video under compile.mode=reduce-overhead: the running sum of training hits was carried into the compiled
  step, so the next CUDA-graph replay overwrote an output still in use; now the step only notes its hits and
  the recipe sums them after it (Recipe.after_step).
- video: the class weights were copied to the device at every step (a host sync under sync-debug mode); then,
  copied once inside the compiled step, they were a CUDA graph's output (the second run): now in before_step.
- train.deterministic on CUDA: MaxPool3d's backward has no deterministic CUDA kernel (the run stopped) and
  KGAT's cuSPARSE product added in a different order per run (a resume differed in the last bits); both take
  paths whose CUDA kernels are deterministic there (window_max, edgewise_mm), equal to the usual ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.opcount import epoch_loop_for
from trainer.recipes.kgat.model import csr_matrix, edgewise_mm
from trainer.recipes.video.model import window_max


def test_training_hits_are_summed_after_the_step_not_inside_it():
    tr, batches = epoch_loop_for("har", [])
    recipe = tr.run.recipe
    recipe.on_epoch_start(0, tr.run.model)
    hits = cases = 0
    for _ in range(2):
        x, lengths, y = next(batches)
        logits = torch.randn(len(y), len(recipe.class_names))
        recipe.counted(logits, y)
        assert recipe._train_hits is None or recipe._train_hits.item() == hits   # nothing summed in the step
        recipe.after_step()
        hits, cases = hits + int((logits.argmax(1) == y).sum()), cases + len(y)
    assert recipe.epoch_metrics()["accuracy"] == hits / cases
    recipe.after_step()                                   # a second call without a step adds nothing
    assert recipe.epoch_metrics()["accuracy"] == hits / cases


def test_the_video_loss_weights_are_copied_once():
    tr, batches = epoch_loop_for("video", ["model.arch=light", "data.size=32", "data.clip_len=9",
                                     "data.synthetic_videos=4", "data.synthetic_frames=30", "train.num_workers=0"])
    recipe, batch = tr.run.recipe, next(batches)
    recipe.before_step(batch)                   # the loop calls it outside the (compiled) training step
    first = recipe._loss_weight
    assert torch.equal(first, recipe.data.weights)
    recipe.training_step(tr.run.model, batch)
    assert recipe._loss_weight is first         # the step made nothing (a CUDA graph's output would be overwritten)


def test_window_max_is_max_pool3d_forward_and_backward():
    torch.manual_seed(0)
    for shape, kernel in (((2, 3, 17, 33, 31), (2, 2, 2)), ((2, 3, 9, 32, 32), (1, 2, 2)), ((1, 2, 5, 6, 7), 2)):
        for ceil in (True, False):
            x = torch.randn(shape, requires_grad=True)
            ours, theirs = window_max(x, kernel, ceil), F.max_pool3d(x, kernel, ceil_mode=ceil)
            assert ours.shape == theirs.shape and torch.equal(ours, theirs)
            g_ours, = torch.autograd.grad((ours * ours).sum(), x)
            g_theirs, = torch.autograd.grad((theirs * theirs).sum(), x)
            assert torch.equal(g_ours, g_theirs), (shape, kernel, ceil)


def test_edgewise_mm_is_the_csr_product_forward_and_backward():
    torch.manual_seed(0)
    n = 60
    key = torch.unique(torch.randint(0, n * n, (400,)))
    rows, cols = key // n, key % n
    crow = torch.zeros(n + 1, dtype=torch.int64)
    crow[1:] = torch.bincount(rows, minlength=n).cumsum(0)
    for index in (torch.int64, torch.int32):
        a = csr_matrix(crow.to(index), cols.to(index), torch.rand(len(key)), (n, n))
        x = torch.randn(n, 8, requires_grad=True)
        ours, theirs = edgewise_mm(a, x), torch.sparse.mm(a, x)
        torch.testing.assert_close(ours, theirs)
        g_ours, = torch.autograd.grad((ours ** 2).sum(), x)
        g_theirs, = torch.autograd.grad((theirs ** 2).sum(), x)
        torch.testing.assert_close(g_ours, g_theirs)
