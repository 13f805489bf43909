"""AdamW, clipping, schedule and loss scaling against direct float64 formulas."""

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from anectypes.optim import CHUNK, AdamW, LossScaler, Schedule, clip_scales, global_norm


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


def test_the_fused_pass_scales_zeroes_and_stages_every_row_once_across_threads():
    """What the trainer asks of one update: gradients scaled (unscale, clip), AdamW, each piece of
    rows handed to stage() right after its update, gradients zeroed, groups on two threads."""
    rng = np.random.default_rng(1)
    shapes = {"embed": (700, 96), "layers.0.w1": (3 * CHUNK // 64 + 5, 64), "layers.0.rms_att": (64,),
              "layers.1.wq": (64, 64)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = {k: rng.standard_normal(s).astype(np.float32) * 100 for k, s in shapes.items()}
    want = {k: v.astype(np.float64) for k, v in params.items()}
    staged = {k: np.zeros(len(v), int) for k, v in params.items()}

    def stage(name, rows):
        assert np.array_equal(params[name][rows], params[name][rows])     # a view of updated rows
        staged[name][rows] += 1

    scales = (1 / 8, 0.5)
    for k in want:
        g = grads[k].astype(np.float64) / 8 * 0.5
        upd = (0.1 * g / 0.1) / (np.sqrt(0.05 * g * g / 0.05) + 1e-8)
        want[k] -= 1e-2 * (upd + (0.0 if "rms" in k else 0.1) * want[k])
    with ThreadPoolExecutor(2) as pool:
        AdamW(params).step(params, grads, 1e-2, scales, zero_grads=True, stage=stage,
                           groups=[["embed"], ["layers.0.w1", "layers.0.rms_att"], ["layers.1.wq"]], map=pool.map)
    for k in want:
        np.testing.assert_allclose(params[k], want[k], rtol=1e-5, atol=1e-6)
        assert not grads[k].any() and (staged[k] == 1).all(), k


def test_schedule_warmup_then_cosine_to_min():
    s = Schedule(max_lr=1.0, warmup=10, total=110, min_frac=0.1)
    assert s.lr(0) == 0.1 and s.lr(9) == 1.0
    assert math.isclose(s.lr(60), 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(s.lr(110), 0.1) and math.isclose(s.lr(500), 0.1)
    assert all(s.lr(i) >= s.lr(i + 1) for i in range(10, 120))


def test_clip_scales():
    rng = np.random.default_rng(2)
    g = {"a": rng.standard_normal((3 * CHUNK // 100, 100)).astype(np.float32) * 8, "b": np.float32([4.0]) * 8}
    norm64 = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values())) / 8
    norm, scales = clip_scales(g, divisor=8, clip=1.0)
    assert math.isclose(norm, norm64, rel_tol=1e-6) and scales == (1 / 8, 1.0 / norm)
    assert math.isclose(global_norm(g, scales[0] * scales[1]), 1.0, rel_tol=1e-6)
    assert clip_scales(g, divisor=8, clip=10 * norm64) == (norm, (1 / 8,))        # below the clip: unscale only
    assert clip_scales({"a": np.float32([1.0, np.inf])}, 1, 1.0) == (None, None)


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
