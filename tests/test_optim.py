"""AdamW, clipping, schedule and loss scaling against direct float64 formulas."""

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from anectypes.train.optim import AdamW, LossScaler, Schedule, clip_scales, global_norm
from anectypes.host.chunks import UPDATE_CHUNK


def test_adamw_matches_the_formula_over_steps():
    rng = np.random.default_rng(0)
    params = {"layers.0.wq": rng.standard_normal((3, 4)).astype(np.float32),
              "layers.0.w1": rng.standard_normal((300, 500)).astype(np.float32),   # updated in pieces
              "layers.0.rms_att": rng.standard_normal(4).astype(np.float32)}
    ref = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(v) for k, v in ref.items()}
    opt = AdamW(params)
    for t in range(1, 6):
        grads = {k: rng.standard_normal(p.shape).astype(np.float32) for k, p in params.items()}
        lr = 1e-2 * t
        opt.step(params, grads, lr)
        for k in ref:
            g = grads[k].astype(np.float64)
            m[k] = 0.9 * m[k] + 0.1 * g
            v[k] = 0.95 * v[k] + 0.05 * g * g
            upd = (m[k] / (1 - 0.9 ** t)) / (np.sqrt(v[k] / (1 - 0.95 ** t)) + 1e-8)
            wd = 0.0 if "rms" in k else 0.1           # no decay on norm weights
            ref[k] = ref[k] - lr * (upd + wd * ref[k])
            np.testing.assert_allclose(params[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lanes", [1, 3])
def test_one_pass_scales_zeroes_and_stages_each_weight_once_updated(lanes):
    """What the trainer asks of one update: the gradient scaled (unscale and clip in one factor),
    AdamW, the gradient zeroed in the same pass, each weight handed to stage() once it is updated;
    on one lane or with the pieces dealt to 3 threads, bit for bit the same."""
    rng = np.random.default_rng(1)
    shapes = {"embed": (700, 96), "layers.0.w1": (3 * UPDATE_CHUNK // 64 + 5, 64), "layers.0.rms_att": (64,),
              "layers.1.wq": (64, 64)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = {k: rng.standard_normal(s).astype(np.float32) * 100 for k, s in shapes.items()}
    want = {k: v.astype(np.float64) for k, v in params.items()}
    staged = []

    def stage(name):
        assert not grads[name].any()             # its pass is over: zeroed, and the weight updated
        np.testing.assert_allclose(params[name], want[name], rtol=1e-5, atol=1e-6)
        staged.append(name)

    for k in want:
        g = grads[k].astype(np.float64) / 16
        upd = (0.1 * g / 0.1) / (np.sqrt(0.05 * g * g / 0.05) + 1e-8)
        want[k] -= 1e-2 * (upd + (0.0 if "rms" in k else 0.1) * want[k])
    one_lane = {k: v.copy() for k, v in params.items()}
    AdamW(one_lane).step(one_lane, {k: g.copy() for k, g in grads.items()}, 1e-2, 1 / 16)
    with ThreadPoolExecutor(lanes) as pool:
        AdamW(params).step(params, grads, 1e-2, 1 / 16, zero_grads=True, stage=stage, map=pool.map, lanes=lanes)
    assert staged == list(shapes)
    for k in params:
        assert np.array_equal(params[k], one_lane[k]), k


def test_schedule_warmup_then_cosine_to_min():
    s = Schedule(max_lr=1.0, warmup=10, total=110, min_frac=0.1)
    assert s.lr(0) == 0.1 and s.lr(9) == 1.0
    assert math.isclose(s.lr(60), 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(s.lr(110), 0.1) and math.isclose(s.lr(500), 0.1)
    assert all(s.lr(i) >= s.lr(i + 1) for i in range(10, 120))


def test_clip_scales():
    rng = np.random.default_rng(2)
    g = {"a": rng.standard_normal((3 * UPDATE_CHUNK // 100, 100)).astype(np.float32) * 8, "b": np.float32([4.0]) * 8}
    norm64 = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values())) / 8
    norm, scale = clip_scales(g, divisor=8, clip=1.0)
    assert math.isclose(norm, norm64, rel_tol=1e-6) and scale == 1.0 / norm / 8
    assert math.isclose(global_norm(g, scale), 1.0, rel_tol=1e-6)
    assert clip_scales(g, divisor=8, clip=10 * norm64) == (norm, 1 / 8)        # below the clip: unscale only
    assert clip_scales({"a": np.float32([1.0, np.inf])}, 1, 1.0) == (None, None)
    with ThreadPoolExecutor(3) as pool:      # the pieces on 3 threads: the same norm, bit for bit
        assert clip_scales(g, divisor=8, clip=1.0, map=pool.map, lanes=3) == (norm, scale)


def test_dynamic_loss_scale_backs_off_and_grows():
    s = LossScaler(256, dynamic=True, growth_interval=2)
    s.update(False)
    assert s.scale == 128
    s.update(True)
    s.update(True)
    assert s.scale == 256
    static = LossScaler(256)
    static.update(False)
    assert static.scale == 256


def test_norm_weights_qk_norm_included_take_no_weight_decay():
    norms = ("layers.0.rms_att", "rms_final", "layers.3.q_norm", "layers.3.k_norm")
    assert [AdamW.decays(n) for n in norms] == [False] * 4
    assert all(AdamW.decays(n) for n in ("layers.0.wq", "embed", "classifier"))
